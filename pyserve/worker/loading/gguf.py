"""GGUF files (llama.cpp), whole or split: metadata → the family's ModelConfig, tensors read lazily.

Each family (pyserve/worker/models/) names its block tensors and says what llama.cpp's converter
changed: it reorders the rows of every Llama q/k projection so that each head's rotary pairs are
adjacent (its rope rotates pairs (2i, 2i+1)), where Hugging Face checkpoints pair ``i`` with
``i + head_dim/2``, and we undo that here so one rope layout serves both formats (the other
families use llama.cpp's "rotate half" rope and are not reordered); it stores Gemma's norm
weights as 1 + w.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

from pyserve.model_files import ModelFilesError, ModelSource, gguf_shards, open_gguf_reader
from pyserve.worker.loading.base import Checkpoint, ModelLoadError, StoredTensor, read_exactly
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.layout import CheckpointTensor, checkpoint_tensors
from pyserve.worker.models.registry import Family, UnsupportedArchitecture, family_for_gguf
from pyserve.worker.quant import MXFP4, ggml_largest_u
from pyserve.worker.rope import check_rope

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Small tensors that describe the rope rather than hold weights: read into the metadata.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def open_gguf_checkpoint(source: ModelSource) -> Checkpoint:
    path = source.path
    try:
        shards = gguf_shards(path)
    except ModelFilesError as e:
        raise ModelLoadError(str(e)) from None
    readers = [_open_reader(shard) for shard in shards]
    names = {t.name for reader in readers for t in reader.tensors}
    family, config = _read_config(readers[0], names, source)  # the metadata: in the first shard
    declared = gguf_names(config, family)
    tensors: list[tuple[str, StoredTensor]] = []
    decodable: dict[str, str | None] = {}
    for shard, reader in zip(shards, readers, strict=True):
        size = os.path.getsize(shard)
        for tensor in reader.tensors:
            if tensor.name in ROPE_TENSORS:
                continue  # already in the config's rope tables
            parts = declared.get(tensor.name)
            if parts is None:
                raise ModelLoadError(f"{shard}: unexpected tensor {tensor.name!r}")
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size:
                raise ModelLoadError(
                    f"{shard}: truncated: tensor {tensor.name!r} ends at byte {end}, "
                    f"the file has {size}"
                )
            problem = decodable.setdefault(
                tensor.tensor_type.name, _undecodable(tensor.tensor_type)
            )
            if problem:
                raise ModelLoadError(f"{shard}: tensor {tensor.name!r}: {problem}")
            stacked = parts[0].expert is not None
            experts = len({part.expert for part in parts})
            # [experts, rows, k] weights, [experts, n] biases
            if stacked and (len(tensor.shape) not in (2, 3) or int(tensor.shape[-1]) != experts):
                raise ModelLoadError(
                    f"{shard}: tensor {tensor.name!r} has shape {list(tensor.shape)}, "
                    f"the config implies {experts} experts"
                )
            for index, part in enumerate(parts):
                piece = (index, len(parts)) if stacked else None
                stored = GGUFTensor(shard, tensor, part.hf, family, config, piece)
                tensors.append((part.hf, stored))
    return Checkpoint(
        path=path,
        config=config,
        family=family,
        tensors=tensors,
        quantization_hint=quantization_hint([t for r in readers for t in r.tensors]),
        norms_include_offset=family.gguf_norms_include_offset,
    )


def _open_reader(path: str):
    try:
        return open_gguf_reader(path)
    except Exception as e:  # a truncated or foreign file fails in many ways inside gguf/numpy
        problem = f"{type(e).__name__}: {e}"
        raise ModelLoadError(f"{path}: not a readable GGUF file ({problem})") from None


_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


def _undecodable(ggml_type) -> str | None:
    """Why tensors of this GGML type cannot be served (None: they can), tried on one block."""
    name = ggml_type.name
    if name in _FLOAT_TYPES or name == "BF16" or name in ggml_largest_u():
        return None
    from gguf import GGML_QUANT_SIZES, dequantize

    try:
        _, type_size = GGML_QUANT_SIZES[ggml_type]
        dequantize(np.zeros((1, type_size), np.uint8), ggml_type)
    except (KeyError, NotImplementedError, ValueError, TypeError) as e:
        return f"GGML type {name} is not supported ({type(e).__name__}: {e})"
    return None


class GGUFTensor(StoredTensor):
    """A GGUF tensor in Hugging Face layout, read with a plain read when asked; the family's
    row order (Llama's q/k) applies to the file's rows, quantized or not."""

    def __init__(
        self,
        file: str,
        tensor,
        hf_name: str,
        family: Family,
        config: ModelConfig,
        # (i, of n): the i-th of n equal runs of a stacked tensor's rows (an expert, or half of
        # one's fused gate/up)
        piece: tuple[int, int] | None = None,
    ):
        self.file, self.name, self._hf_name = file, tensor.name, hf_name
        self.shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF: innermost first
        self.type_name = tensor.tensor_type.name
        self._type = tensor.tensor_type
        self.offset, self.nbytes = int(tensor.data_offset), int(tensor.n_bytes)
        if piece is not None:  # experts lie one after another: [experts, rows, k], [experts, n]
            index, count = piece
            self.nbytes //= count
            self.offset += index * self.nbytes
            experts, *rest = self.shape
            self.shape = (experts * rest[0] // count, *rest[1:])
            self.name = f"{tensor.name}[{index}]"
        self._family, self._config = family, config

    def _rows(self) -> np.ndarray:
        """The file's bytes, [rows, bytes of a row], in Hugging Face's row order."""
        raw = read_exactly(self.file, self.offset, self.nbytes)
        rows = raw.reshape(math.prod(self.shape[:-1]), -1) if len(self.shape) > 1 else raw
        return self._family.gguf_transform(self._hf_name, rows, self._config)

    @property
    def quantized(self) -> bool:
        return self.type_name not in _FLOAT_TYPES and self.type_name != "BF16"

    @property
    def native_bits(self) -> int | None:
        if not self.quantized:
            return None
        if self.type_name == MXFP4:  # 4-bit codes: its 8-bit form is a fallback, not its width
            return 4
        largest = ggml_largest_u().get(self.type_name)
        if largest is not None:
            return 4 if largest <= 15 else 8
        bits = ggml_type_bits(self.type_name)
        return 4 if bits is not None and bits <= 4 else 8

    def values(self) -> torch.Tensor:
        return _RowsOf(self, self._rows()).values()

    def blocks(self) -> np.ndarray | None:
        return self._rows() if self.quantized else None

    def pieces(self, rows: int) -> Iterator[StoredTensor]:
        if len(self.shape) != 2 or self.shape[0] <= rows:
            yield self
            return
        raw = self._rows()  # the file's bytes once (compact), decoded piece by piece
        for start in range(0, self.shape[0], rows):
            yield _RowsOf(self, raw[start : start + rows])


class _RowsOf(StoredTensor):
    """Some rows of a GGUF tensor, their bytes read already."""

    def __init__(self, tensor: GGUFTensor, raw: np.ndarray):
        self.tensor, self.raw = tensor, raw
        self.file, self.name, self.type_name = tensor.file, tensor.name, tensor.type_name
        self.shape = (raw.shape[0], *tensor.shape[1:]) if len(tensor.shape) > 1 else tensor.shape
        self.nbytes = raw.nbytes

    @property
    def quantized(self) -> bool:
        return self.tensor.quantized

    @property
    def native_bits(self) -> int | None:
        return self.tensor.native_bits

    def values(self) -> torch.Tensor:
        rows, kind = self.raw, self.type_name
        try:
            if kind in _FLOAT_TYPES:
                values = torch.from_numpy(np.ascontiguousarray(rows).view(_FLOAT_TYPES[kind]))
            elif kind == "BF16":
                values = torch.from_numpy(np.ascontiguousarray(rows).view(np.int16))
                values = values.view(torch.bfloat16)
            else:
                from gguf import dequantize

                values = torch.from_numpy(dequantize(rows, self.tensor._type))
        except Exception as e:
            raise ModelLoadError(
                f"{self.file}: cannot decode tensor {self.name!r} ({kind}): {type(e).__name__}: {e}"
            ) from None
        return values.reshape(self.shape)

    def blocks(self) -> np.ndarray | None:
        return self.raw if self.quantized else None


# GGML types by their bits a weight: Q4_1 → 4, IQ3_S → 3, TQ2_0 → 2, MXFP4 → 4.
_GGML_BITS = re.compile(r"(?:I|T)?Q(\d)_|MXFP(\d)|NVFP(\d)")
# The projections inside the decoder blocks (the output head stays 8-bit whatever the file says).
_LINEAR_PARTS = (
    *("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
    *("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps"),  # stacked experts
    *("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"),  # its shared expert
)


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


def _read_config(reader, names: set[str], source: ModelSource) -> tuple[Family, ModelConfig]:
    path = source.path
    try:
        family = family_for_gguf(_field(reader, "general.architecture"))
    except UnsupportedArchitecture as e:
        raise ModelLoadError(f"{path}: {e}") from None
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


def gguf_names(config: ModelConfig, family: Family) -> dict[str, list[CheckpointTensor]]:
    """GGUF tensor name → the checkpoint tensors it holds (several: a layer's stacked experts,
    in the order their rows lie), from models/layout.py's declarations."""
    out: dict[str, list[CheckpointTensor]] = {}
    for t in checkpoint_tensors(config, family):
        if t.gguf is not None:
            out.setdefault(t.gguf, []).append(t)
    # llama.cpp's converter with --fuse-gate-up-exps: one [experts, 2·width, hidden] tensor a
    # layer, each expert's gate rows then its up rows
    for name, gates in list(out.items()):
        if name.endswith(".ffn_gate_exps.weight"):
            ups = out[name.replace(".ffn_gate_exps.", ".ffn_up_exps.")]
            fused = name.replace(".ffn_gate_exps.", ".ffn_gate_up_exps.")
            out[fused] = [t for pair in zip(gates, ups, strict=True) for t in pair]
    return out
