"""Qwen2/2.5: a Llama with q/k/v biases, yarn rope scaling when configured, and sliding windows
on the layers past ``max_window_layers`` when ``use_sliding_window`` is on. Qwen2.5-VL's
language model is one, with multimodal rope (``RopeConfig.mrope_section``)."""

from __future__ import annotations

from pyserve.worker.models.registry import Family, register


@register
class Qwen2(Family):
    name = "qwen2"
    hf_model_types = ("qwen2", "qwen2_5_vl_text")
    gguf_architectures = ("qwen2",)

    def hf_features(self, hf) -> dict:
        return {"qkv_bias": True}
