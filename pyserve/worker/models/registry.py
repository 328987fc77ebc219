"""Model families, registered by the architecture names their files carry.

A family (one file each under pyserve/worker/models/) reads its Hugging Face config and its GGUF
metadata into a ModelConfig, names its checkpoint tensors, and says how llama.cpp's converter
laid them out. Adding a family is one file plus its import in ``models/__init__.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pyserve.worker.models.common import (
    GGUFFields,
    gguf_field,
    gguf_moe,
    gguf_rope,
    gguf_shape,
    hf_activation,
    hf_layers,
    hf_moe,
    hf_shape,
    with_moe,
)
from pyserve.worker.models.config import LayerConfig, ModelConfig, uniform_layers
from pyserve.worker.models.layout import FusedExperts


class UnsupportedArchitecture(ValueError):
    """An architecture no family is registered for."""


class Family:
    """The defaults are a Llama's; a family overrides what differs."""

    name = "abstract"
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type"
    gguf_architectures: tuple[str, ...] = ()  # GGUF "general.architecture"
    # q/k/v and gate/up stored fused in Hugging Face checkpoints (Phi-3)
    fused_qkv = False
    fused_gate_up = False
    # llama.cpp's converter reorders each q/k head's rows for its interleaved rope (Llama only)
    gguf_permutes_qk = False
    # llama.cpp's converter stores Gemma's norm weights as 1 + w
    gguf_norms_include_offset = False
    # used when the file carries no chat template (Gemma GGUFs often don't)
    default_chat_template: str | None = None

    def config_from_hf(
        self, hf: Any, name: str, eos: tuple[int, ...], bos: int | None
    ) -> ModelConfig:
        """From a transformers PretrainedConfig (its text config for multimodal checkpoints)."""
        fields = {
            **hf_shape(hf),
            **with_moe(hf_layers(hf), *hf_moe(hf, self.normalize_top_k)),
            "activation": hf_activation(hf),
            **self.hf_features(hf),
        }
        return ModelConfig(
            architecture=self.name, name=name, eos_token_ids=eos, bos_token_id=bos, **fields
        )

    def hf_features(self, hf: Any) -> dict[str, Any]:
        """ModelConfig fields beyond the shape, layers and activation (Llama: its biases)."""
        if getattr(hf, "mlp_bias", False):
            raise ValueError("mlp_bias is not supported")
        bias = bool(getattr(hf, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def config_from_gguf(
        self,
        fields: GGUFFields,
        tensors: set[str],
        name: str,
        eos: tuple[int, ...],
        bos: int | None,
    ) -> ModelConfig:
        arch = str(fields["general.architecture"])
        shape = gguf_shape(fields, arch, tensors)
        moe = gguf_moe(fields, arch, shape, tensors, self.normalize_top_k)
        config = {
            **shape,
            **with_moe(self.gguf_layers(fields, arch, shape), *moe),
            "qkv_bias": "blk.0.attn_q.bias" in tensors,
            "o_bias": "blk.0.attn_output.bias" in tensors,
            **self.gguf_features(fields, arch, shape),
        }
        return ModelConfig(
            architecture=self.name, name=name, eos_token_ids=eos, bos_token_id=bos, **config
        )

    def gguf_layers(
        self, fields: GGUFFields, arch: str, shape: dict[str, Any]
    ) -> tuple[LayerConfig, ...]:
        """Every layer alike: the file's rope table and sliding window (if any)."""
        rope = gguf_rope(fields, arch, shape["head_dim"], fields.get("_tensor:rope_freqs.weight"))
        window = gguf_field(fields, arch, "attention.sliding_window")
        return uniform_layers(shape["num_layers"], rope, int(window) if window else None)

    def gguf_features(self, fields: GGUFFields, arch: str, shape: dict[str, Any]) -> dict:
        """ModelConfig fields beyond the shape, layers and biases."""
        return {}

    # GGUF tensor name → Hugging Face name, for the tensors inside a block ("blk.N.<part>")
    gguf_layer_parts: dict[str, str] = {
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

    # the sparse MLP's module in Hugging Face checkpoints, and its experts' gate, up and down
    # projections (Mixtral: "block_sparse_moe", w1, w3, w2)
    hf_moe_prefix = "mlp"
    # a mixture's top-k probabilities renormalized where the config has no norm_topk_prob (and
    # in GGUF files, which carry it for few architectures: llama.cpp's rule per architecture)
    normalize_top_k = True
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    hf_router_name = "gate"  # the router's module under hf_moe_prefix
    # how the experts are stored where a checkpoint fuses them into 3-D tensors (None: the
    # family's checkpoints hold one tensor per expert and projection)
    hf_fused_experts: FusedExperts | None = None

    def gguf_part_of(self, hf_part: str) -> str | None:
        """llama.cpp's name for a block tensor's Hugging Face part ("self_attn.q_proj" →
        "attn_q"), None where the family's files have none."""
        return {hf: gguf for gguf, hf in self.gguf_layer_parts.items()}.get(hf_part)

    def gguf_transform(self, hf_name: str, values: np.ndarray, config: ModelConfig) -> np.ndarray:
        """A GGUF tensor (already in HF's [out, in] shape) as the HF checkpoint holds it."""
        if self.gguf_permutes_qk:
            if ".q_proj." in hf_name:
                return unpermute_rope_rows(values, config.num_heads)
            if ".k_proj." in hf_name:
                return unpermute_rope_rows(values, config.num_kv_heads)
        return values


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row order: per head, rows (j, a) back to (a, j), a ∈ {0, 1}."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


_BY_NAME: dict[str, Family] = {}
_BY_HF: dict[str, Family] = {}
_BY_GGUF: dict[str, Family] = {}


def register(cls: type[Family]) -> type[Family]:
    family = cls()
    _BY_NAME[family.name] = family
    for t in family.hf_model_types:
        _BY_HF[t] = family
    for a in family.gguf_architectures:
        _BY_GGUF[a] = family
    return cls


def _families_loaded() -> None:
    import pyserve.worker.models  # noqa: F401 (imports every family, which registers it)


def supported(kind: str) -> list[str]:
    _families_loaded()
    return sorted(_BY_HF if kind == "hf" else _BY_GGUF)


def _lookup(table: dict[str, Family], arch: object, kind: str, label: str) -> Family:
    _families_loaded()
    family = table.get(str(arch)) if arch is not None else None
    if family is None:
        raise UnsupportedArchitecture(
            f"{label} {arch!r} is not supported (supported: {', '.join(supported(kind))})"
        )
    return family


def family_for_hf(model_type: object) -> Family:
    """The family of a config.json ``model_type``."""
    return _lookup(_BY_HF, model_type, "hf", "architecture")


def family_for_gguf(architecture: object) -> Family:
    """The family of a GGUF ``general.architecture``."""
    return _lookup(_BY_GGUF, architecture, "gguf", "GGUF architecture")
