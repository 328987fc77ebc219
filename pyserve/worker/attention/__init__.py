"""Attention backends over the paged KV cache; ``create_attention_backend`` picks one per device."""

from __future__ import annotations

import torch

from pyserve.worker.attention.base import AttentionBackend
from pyserve.worker.kv_cache import PagedKVCache

__all__ = ["AttentionBackend", "create_attention_backend"]


def create_attention_backend(
    device: torch.device | str,
    kv_cache: PagedKVCache,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> AttentionBackend:
    """The CPU backend everywhere for now; a CUDA backend (paged kernels) slots in here."""
    # The gather-then-matmul backend is plain torch, so it is also correct (if not fast) on CUDA.
    from pyserve.worker.attention.cpu import CpuAttentionBackend

    del device
    return CpuAttentionBackend(
        kv_cache, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
