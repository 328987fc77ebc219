"""GGUF files (llama.cpp): metadata → the family's ModelConfig, tensors dequantized to float32.

Each family (pyserve/worker/models/) names its block tensors and says what llama.cpp's converter
changed: it reorders the rows of every Llama q/k projection so that each head's rotary pairs are
adjacent (its rope rotates pairs (2i, 2i+1)), where Hugging Face checkpoints pair ``i`` with
``i + head_dim/2``, and we undo that here so one rope layout serves both formats (the other
families use llama.cpp's "rotate half" rope and are not reordered); it stores Gemma's norm
weights as 1 + w.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from pyserve.model_files import ModelSource
from pyserve.worker.loading.base import Checkpoint, ModelLoadError
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.registry import Family, UnsupportedArchitecture, family_for_gguf
from pyserve.worker.rope import check_rope

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Small tensors that describe the rope rather than hold weights: read into the metadata.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _plain_view_reader(path: str):
    """A GGUFReader that parses from a plain ndarray view of its memory map.

    Every slice of an ``np.memmap`` runs Python-level ``__array_finalize__``; the reader slices
    once per metadata item (~150k for a BPE vocabulary), which made parsing take 2+ s. The same
    mapping viewed as a plain ndarray parses about 3x faster and reads identical bytes.
    """
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        def _get(self, *args, **kwargs):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)
            return super()._get(*args, **kwargs)

    return PlainViewReader(path)


def open_gguf_checkpoint(source: ModelSource) -> Checkpoint:
    path = source.path
    try:
        reader = _plain_view_reader(path)
    except Exception as e:  # a truncated or foreign file fails in many ways inside gguf/numpy
        problem = f"{type(e).__name__}: {e}"
        raise ModelLoadError(f"{path}: not a readable GGUF file ({problem})") from None
    family, config = _read_config(reader, source)
    return Checkpoint(
        path=path,
        config=config,
        family=family,
        tensors=lambda: _iter_tensors(reader, family, config, path),
        quantization_hint=quantization_hint(reader.tensors),
        norms_include_offset=family.gguf_norms_include_offset,
    )


# GGML types by their bits a weight: Q4_1 → 4, IQ3_S → 3, TQ2_0 → 2, MXFP4 → 4.
_GGML_BITS = re.compile(r"(?:I|T)?Q(\d)_|MXFP(\d)|NVFP(\d)")
# The projections inside the decoder blocks (the output head stays 8-bit whatever the file says).
_LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def ggml_type_bits(type_name: str) -> int | None:
    """Bits a weight of a quantized GGML type (its integer part); None for float types."""
    match = _GGML_BITS.match(type_name)
    if match is None:
        return None
    return int(next(g for g in match.groups() if g is not None))


def quantization_hint(tensors) -> str | None:
    """The kernel precision closest to what the file stores its decoder projections in.

    Decided by the type holding most of their weights (a Q4_K_M file keeps a few tensors in
    Q6_K): 4 bits or fewer → int4 (Q4_1 comes back bit for bit), 5 to 8 bits → int8 (more
    precise than the file), float types → None (serve them unquantized).
    """
    weights_by_bits: dict[int | None, int] = {}
    for tensor in tensors:
        match = _LAYER_NAME.fullmatch(tensor.name)
        if match is None or match.group(2) not in _LINEAR_PARTS or match.group(3) != "weight":
            continue
        bits = ggml_type_bits(tensor.tensor_type.name)
        weights_by_bits[bits] = weights_by_bits.get(bits, 0) + int(tensor.n_elements)
    if not weights_by_bits:
        return None
    bits = max(weights_by_bits, key=weights_by_bits.__getitem__)
    if bits is None:
        return None
    return "int4" if bits <= 4 else "int8"


def _field(reader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _metadata(reader) -> dict:
    """Every scalar and short metadata field, the vocabulary size, and the rope tensors' values
    (``_tensor:<name>``): what a family reads its config from."""
    fields: dict = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in _TOKEN_ID_KEYS:
            continue
        fields[key] = field.contents()
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        fields["_vocab_size"] = len(tokens.data)
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            fields[f"_tensor:{tensor.name}"] = tuple(float(x) for x in values)
    return fields


_TOKEN_ID_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.bos_token_id",
)


def _read_config(reader, source: ModelSource) -> tuple[Family, ModelConfig]:
    path = source.path
    try:
        family = family_for_gguf(_field(reader, "general.architecture"))
    except UnsupportedArchitecture as e:
        raise ModelLoadError(f"{path}: {e}") from None
    names = {t.name for t in reader.tensors}
    try:
        fields = _metadata(reader)
        eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        eos = tuple(dict.fromkeys(int(fields[k]) for k in eos_keys if k in fields))
        bos = fields.get("tokenizer.ggml.bos_token_id")
        config = family.config_from_gguf(
            fields, names, source.name, eos, int(bos) if bos is not None else None
        )
        for layer in config.layers:
            check_rope(layer.rope)
        return family, config
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: missing or invalid GGUF metadata ({e!r})") from None


def hf_name(gguf_name: str, family: Family) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors that are not weights."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in family.gguf_layer_parts:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{family.gguf_layer_parts[part]}.{kind}"
    return None


def _iter_tensors(
    reader, family: Family, config: ModelConfig, path: str
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize

    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            continue  # already in the config's rope tables
        name = hf_name(tensor.name, family)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r}")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        try:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except Exception as e:
            raise ModelLoadError(
                f"{path}: cannot decode tensor {tensor.name!r} "
                f"({tensor.tensor_type.name}): {type(e).__name__}: {e}"
            ) from None
        values = family.gguf_transform(name, values, config)
        # F32 tensors are read-only views of the file: copy those; dequantized ones are fresh
        yield name, torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
