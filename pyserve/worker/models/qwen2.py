"""Qwen2/2.5: a Llama with q/k/v biases, yarn rope scaling when configured, and sliding windows
on the layers past ``max_window_layers`` when ``use_sliding_window`` is on. Qwen2.5-VL's
language model is one, with multimodal rope (``RopeConfig.mrope_section``); llama.cpp names its
GGUF files ``qwen2vl`` and writes the sections as ``rope.dimension_sections``."""

from __future__ import annotations

import dataclasses
from typing import Any

from pyserve.worker.models.common import gguf_field
from pyserve.worker.models.config import LayerConfig
from pyserve.worker.models.registry import Family, register


@register
class Qwen2(Family):
    name = "qwen2"
    hf_model_types = ("qwen2", "qwen2_5_vl_text")
    gguf_architectures = ("qwen2", "qwen2vl")

    def hf_features(self, hf) -> dict:
        return {"qkv_bias": True}

    def gguf_layers(self, fields, arch: str, shape: dict[str, Any]) -> tuple[LayerConfig, ...]:
        layers = super().gguf_layers(fields, arch, shape)
        sections = [int(n) for n in gguf_field(fields, arch, "rope.dimension_sections", ())]
        while sections and sections[-1] == 0:  # the converter pads to four sections
            sections.pop()
        if not sections:
            return layers
        return tuple(
            dataclasses.replace(
                layer, rope=dataclasses.replace(layer.rope, mrope_section=tuple(sections))
            )
            for layer in layers
        )
