"""OLMoE: a Llama block whose q and k are RMS-normalized over all their heads at once (not per
head), with a mixture of experts on every layer whose top-k probabilities stay as the softmax
gave them."""

from __future__ import annotations

from pyserve.worker.models.common import gguf_field
from pyserve.worker.models.registry import Family, register


@register
class Olmoe(Family):
    name = "olmoe"
    hf_model_types = ("olmoe",)
    gguf_architectures = ("olmoe",)
    normalize_top_k = False  # transformers' default and llama.cpp's rule for olmoe files
    gguf_layer_parts = {
        **Family.gguf_layer_parts,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }

    def hf_features(self, hf) -> dict:
        if getattr(hf, "clip_qkv", None):
            raise ValueError("clip_qkv is not supported")
        return {**super().hf_features(hf), "qk_norm": True, "qk_norm_full_width": True}

    def gguf_features(self, fields, arch, shape) -> dict:
        if gguf_field(fields, arch, "attention.clamp_kqv"):
            raise ValueError("attention.clamp_kqv is not supported")
        return {"qk_norm": True, "qk_norm_full_width": True}
