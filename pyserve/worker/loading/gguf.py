"""GGUF files (llama.cpp): metadata → ModelConfig, tensors dequantized to float32 at load.

llama.cpp's converter reorders the rows of every Llama q/k projection so that each head's
rotary pairs are adjacent (its rope rotates pairs (2i, 2i+1)); Hugging Face checkpoints pair
``i`` with ``i + head_dim/2``. We undo that reordering here so one rope layout serves both formats.
Qwen2 GGUFs are not reordered (llama.cpp uses the "rotate half" rope for them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from pyserve.model_files import ModelSource
from pyserve.worker.loading.base import Checkpoint, ModelLoadError
from pyserve.worker.models.config import ModelConfig

# GGUF architecture → ours. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"


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
    config = _read_config(reader, source)
    return Checkpoint(
        path=path,
        config=config,
        tensors=lambda: _iter_tensors(reader, config, path),
        quantization_hint=quantization_hint(reader.tensors),
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


def _read_config(reader, source: ModelSource) -> ModelConfig:
    path = source.path
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def arch_field(key: str, default: object = None) -> object:
        return _field(reader, f"{gguf_arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    try:
        heads = int(arch_field("attention.head_count"))
        hidden = int(arch_field("embedding_length"))
        vocab = arch_field("vocab_size")
        if vocab is None:
            vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        rope_scaling = None
        scaling_type = arch_field("rope.scaling.type", "none")
        if scaling_type == "linear":
            factor = float(arch_field("rope.scaling.factor"))
            rope_scaling = {"rope_type": "linear", "factor": factor}
        elif scaling_type not in ("none", None):
            raise ModelLoadError(f"{path}: rope scaling {scaling_type!r} is not supported")
        eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        eos = [int(_field(reader, k)) for k in eos_keys if k in reader.fields]
        bos = _field(reader, "tokenizer.ggml.bos_token_id")
        freq_factors = None
        if ROPE_FREQS in names:  # llama3 rope scaling, stored as per-frequency divisors
            tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
            freq_factors = tuple(float(x) for x in np.asarray(tensor.data, dtype=np.float32))
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[gguf_arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(arch_field("feed_forward_length")),
            num_layers=int(arch_field("block_count")),
            num_heads=heads,
            num_kv_heads=int(arch_field("attention.head_count_kv") or heads),
            head_dim=int(arch_field("attention.key_length") or hidden // heads),
            rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(arch_field("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rope_freq_factors=freq_factors,
            context_length=int(arch_field("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=int(bos) if bos is not None else None,
            name=source.name,
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: missing or invalid GGUF metadata ({e!r})") from None


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors that are not weights."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _PER_LAYER:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_PER_LAYER[part]}.{kind}"
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row order: per head, rows (j, a) back to (a, j), a ∈ {0, 1}."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _iter_tensors(reader, config: ModelConfig, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize

    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # already in config.rope_freq_factors
        name = hf_name(tensor.name)
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
        if config.architecture == "llama":
            if ".q_proj." in name:
                values = unpermute_rope_rows(values, config.num_heads)
            elif ".k_proj." in name:
                values = unpermute_rope_rows(values, config.num_kv_heads)
        # F32 tensors are read-only views of the file: copy those; dequantized ones are fresh
        yield name, torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
