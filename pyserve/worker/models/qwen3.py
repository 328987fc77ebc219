"""Qwen3: a Llama with an RMSNorm over each q and k head before RoPE (``q_norm``, ``k_norm``),
optional attention biases and sliding windows as Qwen2's."""

from __future__ import annotations

from pyserve.worker.models.registry import Family, register


@register
class Qwen3(Family):
    name = "qwen3"
    hf_model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)
    gguf_layer_parts = {
        **Family.gguf_layer_parts,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }

    def hf_features(self, hf) -> dict:
        return {**super().hf_features(hf), "qk_norm": True}

    def gguf_features(self, fields, arch, shape) -> dict:
        return {"qk_norm": True}
