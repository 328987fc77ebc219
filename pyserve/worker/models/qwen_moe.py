"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention with a mixture of experts in place of
the MLP (on every ``decoder_sparse_step``-th layer outside ``mlp_only_layers``). Qwen2-MoE adds a
shared expert that every token runs, scaled by sigmoid(x · shared_expert_gate), and keeps the
top-k probabilities as the softmax gave them; Qwen3-MoE renormalizes them (norm_topk_prob)."""

from __future__ import annotations

from pyserve.worker.models.qwen2 import Qwen2
from pyserve.worker.models.qwen3 import Qwen3
from pyserve.worker.models.registry import register


@register
class Qwen2Moe(Qwen2):
    name = "qwen2moe"
    hf_model_types = ("qwen2_moe",)
    gguf_architectures = ("qwen2moe",)
    normalize_top_k = False  # llama.cpp's rule for qwen2moe files


@register
class Qwen3Moe(Qwen3):
    name = "qwen3moe"
    hf_model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
