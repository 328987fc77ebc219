"""Phi-3/3.5: a Llama whose checkpoints store q/k/v and gate/up fused, with partial rotary where
configured, longrope scaling for the 128k variants (short factors within the original context,
long ones past it, cos/sin scaled), and a sliding window on every layer when configured."""

from __future__ import annotations

from pyserve.worker.models.common import gguf_field, gguf_rope
from pyserve.worker.models.config import LayerConfig, RopeConfig, uniform_layers
from pyserve.worker.models.registry import Family, register


@register
class Phi3(Family):
    name = "phi3"
    hf_model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    fused_qkv = True
    fused_gate_up = True
    gguf_layer_parts = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    }

    def gguf_layers(self, fields, arch, shape) -> tuple[LayerConfig, ...]:
        rope = gguf_rope(fields, arch, shape["head_dim"])
        long = fields.get("_tensor:rope_factors_long.weight")
        short = fields.get("_tensor:rope_factors_short.weight")
        if long is not None and short is not None:
            scaling = {
                "rope_type": "longrope",
                "long_factor": list(long),
                "short_factor": list(short),
                "original_max_position_embeddings": int(
                    gguf_field(fields, arch, "rope.scaling.original_context_length")
                ),
            }
            factor = gguf_field(fields, arch, "rope.scaling.attn_factor")
            if factor is not None:
                scaling["attention_factor"] = float(factor)
            rope = RopeConfig(
                theta=rope.theta,
                rotary_dim=rope.rotary_dim,
                scaling=scaling,
                max_position_embeddings=shape["context_length"],
            )
        window = gguf_field(fields, arch, "attention.sliding_window")
        return uniform_layers(shape["num_layers"], rope, int(window) if window else None)
