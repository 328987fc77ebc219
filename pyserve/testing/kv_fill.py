"""Random contents for a paged KV cache, for tests and benchmarks that attend over contexts
they did not prefill."""

from __future__ import annotations

import torch

from pyserve.worker.kv_cache import PagedKVCache


def fill_random(cache: PagedKVCache, generator: torch.Generator) -> None:
    """Every block of every layer: unit-normal values in a float cache; for an int8 cache random
    int8 values and scales in [0, 1/64), so dequantized values are of unit scale too."""
    for t in cache.k + cache.v:
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, generator=generator, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=generator))
    for t in cache.k_scale + cache.v_scale:
        t.copy_(torch.rand(t.shape, generator=generator) / 64)
