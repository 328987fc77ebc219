"""How the Triton kernels address an int8 cache's scales (FlatKVCache's layout): float16
``[slots, kv_heads, groups]`` beside K and V, a scale per KV_INT8_GROUP (32) values of a head
(llama.cpp's q8_0 grouping, kv_cache.quantize_int8's numerics). A kernel's head tile of BLOCK_D
(a power of two) dims holds ``int8_block_groups(BLOCK_D)`` groups: the real ones and, past a
head_dim that is not a power of two, whole groups of masked (zero) dims with scale 0."""

from __future__ import annotations

import torch

from pyserve.worker.dtypes import KV_INT8_GROUP, kv_int8_groups


def int8_block_groups(block_d: int) -> int:
    """Groups in a tile of ``block_d`` dims: of KV_INT8_GROUP dims each, or one group of all of
    them in a tile narrower than a group (a head_dim under 32)."""
    return max(1, block_d // KV_INT8_GROUP)


def check_int8_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """Raises unless both scales fit an int8 cache [slots, kv_heads, head_dim]: contiguous
    float16 [slots, kv_heads, groups]."""
    slots, kv_heads, head_dim = k_cache.shape
    expected = (slots, kv_heads, kv_int8_groups(head_dim))
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.dtype != torch.float16 or t.shape != expected or not t.is_contiguous():
            raise ValueError(f"an int8 cache needs {name}: contiguous float16 {expected}")
