"""gpt-oss: a mixture of experts on every layer whose router has a bias and takes the softmax of
its k largest logits alone; experts with biases and a clamped SwiGLU ((up + 1) · gate ·
sigmoid(1.702 · gate), gate and up clamped); attention with biases on q/k/v and o, a learned
sink logit per head, and a sliding window on every other layer (the even ones); yarn rope.

Hugging Face checkpoints hold the experts fused ([experts, hidden, 2·width] with gate and up
outputs alternating; see layout.FusedExperts); llama.cpp's converter splits them into stacked
gate, up and down tensors with their biases. Its chat format (harmony) is the tokenizer's
template, parsed by pyserve/chat/."""

from __future__ import annotations

from dataclasses import replace

from pyserve.worker.models.common import gguf_field, gguf_rope
from pyserve.worker.models.config import LayerConfig
from pyserve.worker.models.gemma2 import gguf_swa_layers
from pyserve.worker.models.layout import FusedExperts
from pyserve.worker.models.registry import Family, register


@register
class GptOss(Family):
    name = "gpt-oss"
    hf_model_types = ("gpt_oss",)
    gguf_architectures = ("gpt-oss",)
    hf_router_name = "router"
    hf_fused_experts = FusedExperts(transposed=True, interleaved=True)
    gguf_layer_parts = {
        **Family.gguf_layer_parts,
        "post_attention_norm": "post_attention_layernorm",
    }
    gguf_swa_pattern = 2  # llama.cpp's: the even layers attend through the window

    def config_from_hf(self, hf, name, eos, bos):
        config = super().config_from_hf(hf, name, eos, bos)
        assert config.moe is not None
        moe = replace(config.moe, router_bias=True, expert_bias=True, softmax_after_top_k=True)
        return replace(config, moe=moe)

    def hf_features(self, hf) -> dict:
        bias = bool(getattr(hf, "attention_bias", True))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "attention_sinks": True,
            "activation": "clamped_swiglu",
            "swiglu_alpha": float(getattr(hf, "swiglu_alpha", 1.702)),
            "swiglu_limit": float(getattr(hf, "swiglu_limit", 7.0)),
        }

    def config_from_gguf(self, fields, tensors, name, eos, bos):
        config = super().config_from_gguf(fields, tensors, name, eos, bos)
        if config.moe is None:
            raise ValueError("a gpt-oss file without experts (expert_count)")
        moe = replace(
            config.moe,
            router_bias="blk.0.ffn_gate_inp.bias" in tensors,
            expert_bias="blk.0.ffn_up_exps.bias" in tensors,
            softmax_after_top_k=True,
        )
        return replace(config, moe=moe)

    def gguf_layers(self, fields, arch, shape) -> tuple[LayerConfig, ...]:
        rope = gguf_rope(fields, arch, shape["head_dim"])
        if rope.scaling is not None and rope.scaling["rope_type"] == "yarn":
            # transformers' gpt-oss config: the yarn ramp's ends are not rounded
            rope = replace(rope, scaling={**rope.scaling, "truncate": False})
        window = int(gguf_field(fields, arch, "attention.sliding_window"))
        windowed = gguf_swa_layers(fields, arch, shape["num_layers"], self.gguf_swa_pattern)
        return tuple(LayerConfig(rope, window if w else None) for w in windowed)

    def gguf_features(self, fields, arch, shape) -> dict:
        # llama.cpp's constants for the architecture (its converter writes neither)
        return {"attention_sinks": True, "activation": "clamped_swiglu"}
