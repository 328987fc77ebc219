"""Gemma 3 (text): Gemma 2's blocks with an RMSNorm over each q and k head, five sliding-window
layers to each global one, each kind with its own rope table (local base 10k; global 1M, often
linearly scaled), and no soft-capping."""

from __future__ import annotations

from pyserve.worker.models.common import gguf_field, gguf_rope
from pyserve.worker.models.config import LayerConfig, RopeConfig
from pyserve.worker.models.gemma2 import Gemma2, gguf_swa_layers
from pyserve.worker.models.registry import register

GGUF_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's, for the sliding-window layers, unless the file says


@register
class Gemma3(Gemma2):
    name = "gemma3"
    hf_model_types = ("gemma3_text", "gemma3")
    gguf_architectures = ("gemma3",)
    gguf_layer_parts = {
        **Gemma2.gguf_layer_parts,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    gguf_swa_pattern = 6
    gguf_big_layers = 62

    def hf_features(self, hf) -> dict:
        return {**super().hf_features(hf), "qk_norm": True}

    def gguf_layers(self, fields, arch, shape) -> tuple[LayerConfig, ...]:
        global_rope = gguf_rope(fields, arch, shape["head_dim"])
        local_base = gguf_field(fields, arch, "rope.freq_base_swa", GGUF_LOCAL_ROPE_BASE)
        local_rope = RopeConfig(
            theta=float(local_base),
            rotary_dim=global_rope.rotary_dim,
            max_position_embeddings=global_rope.max_position_embeddings,
        )
        window = int(gguf_field(fields, arch, "attention.sliding_window", 4096))
        swa = gguf_swa_layers(fields, arch, shape["num_layers"], self.gguf_swa_pattern)
        return tuple(
            LayerConfig(local_rope, window) if s else LayerConfig(global_rope) for s in swa
        )

    def gguf_features(self, fields, arch, shape) -> dict:
        # no soft-capping in Gemma 3 (llama.cpp reads none for it)
        features = {**super().gguf_features(fields, arch, shape), "qk_norm": True}
        return {**features, "attn_softcap": None, "final_softcap": None}
