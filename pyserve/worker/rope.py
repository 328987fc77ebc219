"""Rotary position embeddings: each rope table's inverse frequencies (plain, linear, llama3, yarn,
longrope), its cos/sin for a forward's positions, and their application.

The rotation pairs dimension ``i`` with ``i + rotary_dim/2`` (the "rotate half" layout of Hugging
Face checkpoints) over a head's first ``rotary_dim`` dimensions; the rest pass through (partial
rotary). GGUF q/k weights are un-permuted at load where llama.cpp permuted them, so the same
layout applies to every file. The frequencies are computed the way transformers computes them,
so that float32 results match it.
"""

from __future__ import annotations

import math

import torch

from pyserve.worker.models.config import RopeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type(rope: RopeConfig) -> str:
    scaling = rope.scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_rope(rope: RopeConfig) -> None:
    """Raises ValueError for a table this module cannot compute."""
    kind = rope_type(rope)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling {kind!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope.rotary_dim < 2 or rope.rotary_dim % 2:
        raise ValueError(f"rotary dimension {rope.rotary_dim} must be even and >= 2")
    if kind in ("yarn", "longrope") and not (rope.scaling or {}).get(
        "original_max_position_embeddings"
    ):
        raise ValueError(f"rope {kind} needs original_max_position_embeddings")


def _plain_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(float32 [rotary_dim / 2], the attention factor that scales cos and sin) for positions
    within the original context; longrope's other table is ``long_inverse_frequencies``."""
    check_rope(rope)
    kind, scaling, dim = rope_type(rope), rope.scaling or {}, rope.rotary_dim
    inv_freq = _plain_inv_freq(rope.theta, dim)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(rope)
    if kind == "longrope":
        return _longrope(rope, scaling["short_factor"])
    return inv_freq, 1.0


def long_inverse_frequencies(rope: RopeConfig) -> torch.Tensor | None:
    """Longrope's table for requests past the original context; None for other kinds."""
    if rope_type(rope) != "longrope":
        return None
    return _longrope(rope, rope.scaling["long_factor"])[0]  # type: ignore[index]


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


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 long context): interpolated low frequencies, extrapolated high ones, a
    linear ramp between, and cos/sin scaled by the attention factor."""
    scaling, dim, base = rope.scaling or {}, rope.rotary_dim, rope.theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = (rope.max_position_embeddings or original) / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # how much of a frequency is extrapolated (kept)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope(rope: RopeConfig, factors: list[float]) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k): per-frequency divisors, one list for positions within the original
    context and one past it; cos/sin scaled by the attention factor."""
    scaling, dim = rope.scaling or {}, rope.rotary_dim
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = (rope.max_position_embeddings or original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * rope.theta**shape), float(attention_factor)


class RotaryTable:
    """cos/sin of one rope table for a forward's positions.

    Longrope has two tables, for sequences within the original context and past it. The table
    is chosen once, from the context the server serves (``context``), as llama.cpp chooses it:
    transformers switches tables when a sequence crosses the original context and then recomputes
    the whole sequence's keys, which a paged cache shared between requests cannot do. Both agree
    wherever a request's length and the served context lie on the same side of the original.
    """

    def __init__(self, rope: RopeConfig, device: torch.device | str = "cpu", context: int = 0):
        inv_freq, self.attention_factor = inverse_frequencies(rope)
        long = long_inverse_frequencies(rope)
        original = int((rope.scaling or {}).get("original_max_position_embeddings") or 0)
        self.long = long is not None and context > original
        self.inv_freq = (long if self.long else inv_freq).to(device)  # type: ignore[union-attr]
        self.rotary_dim = rope.rotary_dim
        self.mrope_section = list(rope.mrope_section or ())
        if self.mrope_section and sum(self.mrope_section) != self.rotary_dim // 2:
            raise ValueError(
                f"mrope_section {self.mrope_section} does not cover the {self.rotary_dim // 2} "
                "rotated pairs"
            )

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, each [T, 1, rotary_dim], broadcastable over heads.
        ``positions``: [T], or with multimodal rope [3, T] (temporal, height, width)."""
        if positions.dim() == 2:
            # each section of pairs turns by one of the three positions, in turn (transformers'
            # recomposition: section i takes axis i % 3)
            freqs = positions.to(torch.float32)[:, :, None] * self.inv_freq
            sections = freqs.split(self.mrope_section, dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(sections)], dim=-1)
        else:
            freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # the first half of the rotated dims turns by -sin against the second half, the second
        # by +sin
        full_cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
        return full_cos, signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] → the same, its first ``cos.shape[-1]`` dims of each head rotated
    (rotate-half layout: i pairs with i + rotary_dim/2), the rest as they are.

    Per pair: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), bit-identical to transformers.
    """
    rotary = cos.shape[-1]
    rot = x if rotary == x.shape[-1] else x[..., :rotary]
    half = rotary // 2
    swapped = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)
    rotated = rot * cos + swapped * signed_sin
    return rotated if rotary == x.shape[-1] else torch.cat((rotated, x[..., rotary:]), dim=-1)
