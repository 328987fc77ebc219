"""Gemma 2: (1 + w) RMSNorms, norms before and after both attention and the MLP ("sandwich"),
a GELU-tanh gate, embeddings scaled by √hidden, attention scaled by query_pre_attn_scalar^-0.5,
attention and final-logit soft-capping, and a sliding window on every other layer (the even
ones)."""

from __future__ import annotations

from pyserve.worker.models.common import (
    gguf_field,
    gguf_rope,
)
from pyserve.worker.models.config import LayerConfig
from pyserve.worker.models.registry import Family, register

# Gemma's chat format; the system message, which Gemma has no turn for, opens the first user turn
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

SANDWICH_PARTS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_swa_layers(fields: dict, arch: str, count: int, pattern: int) -> list[bool]:
    """Which layers attend through the window: the file's ``sliding_window_pattern`` (a period,
    or a flag per layer) where it has one, else llama.cpp's period ``pattern`` (within each run
    of that many layers, all but the last)."""
    given = gguf_field(fields, arch, "attention.sliding_window_pattern")
    if isinstance(given, (list, tuple)):
        if len(given) != count:
            raise ValueError(f"sliding_window_pattern has {len(given)} flags for {count} layers")
        return [bool(flag) for flag in given]
    if given:
        pattern = int(given)
    return [layer % pattern < pattern - 1 for layer in range(count)]


@register
class Gemma2(Family):
    name = "gemma2"
    hf_model_types = ("gemma2",)
    gguf_architectures = ("gemma2",)
    gguf_norms_include_offset = True
    default_chat_template = GEMMA_CHAT_TEMPLATE
    gguf_layer_parts = {**Family.gguf_layer_parts, **SANDWICH_PARTS}
    gguf_swa_pattern = 2  # llama.cpp's: the even layers attend through the window
    gguf_big_layers = 46  # the 27B model's blocks (its attention scale differs)

    def hf_features(self, hf) -> dict:
        bias = bool(getattr(hf, "attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "norm_offset": 1.0,
            "sandwich_norms": True,
            "attention_scale": float(hf.query_pre_attn_scalar) ** -0.5,
            "attn_softcap": _cap(getattr(hf, "attn_logit_softcapping", None)),
            "final_softcap": _cap(getattr(hf, "final_logit_softcapping", None)),
            "embedding_scale": hf.hidden_size**0.5,
        }

    def gguf_layers(self, fields, arch, shape) -> tuple[LayerConfig, ...]:
        rope = gguf_rope(fields, arch, shape["head_dim"])
        window = int(gguf_field(fields, arch, "attention.sliding_window", 4096))
        swa = gguf_swa_layers(fields, arch, shape["num_layers"], self.gguf_swa_pattern)
        return tuple(LayerConfig(rope, window if s else None) for s in swa)

    def gguf_features(self, fields, arch, shape) -> dict:
        # GGUF files carry no query_pre_attn_scalar: an attention.scale if they have one, else
        # llama.cpp's rule: head_dim^-0.5, but (hidden / heads)^-0.5 for the 27B models
        big = shape["num_layers"] == self.gguf_big_layers
        scalar = (shape["hidden_size"] / shape["num_heads"]) if big else shape["head_dim"]
        scale = float(gguf_field(fields, arch, "attention.scale", scalar**-0.5))
        return {
            "norm_offset": 1.0,
            "sandwich_norms": True,
            "activation": "gelu_tanh",
            "attention_scale": scale,
            # llama.cpp's defaults where the file has no value
            "attn_softcap": _cap(gguf_field(fields, arch, "attn_logit_softcapping", 50.0)),
            "final_softcap": _cap(gguf_field(fields, arch, "final_logit_softcapping", 30.0)),
            "embedding_scale": shape["hidden_size"] ** 0.5,
        }


def _cap(value: object) -> float | None:
    return float(value) if value else None  # type: ignore[arg-type]
