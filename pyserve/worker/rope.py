"""Rotary position embeddings: inverse frequencies (plain, linear, llama3) and their application.

The rotation pairs dimension ``i`` with ``i + head_dim/2`` (the "rotate half" layout of Hugging
Face checkpoints); GGUF q/k weights are un-permuted at load so the same layout applies to them.
"""

from __future__ import annotations

import math

import torch

from pyserve.worker.models.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim / 2], computed the way transformers does so fp32 results match it."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(in_between, ramp, scaled)


class RotaryEmbedding:
    """cos/sin for a forward's positions, computed once and shared by every layer."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        self.inv_freq = inverse_frequencies(config).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sign-folded sin, each [T, 1, head_dim], broadcastable over heads."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        # the first half of a head rotates by -sin against the second half, the second by +sin
        full_cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
        return full_cos, signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] → the same, rotated (rotate-half layout: i pairs with i + d/2).

    Per pair: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), bit-identical to transformers.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin
