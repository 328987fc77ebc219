"""The attention backend interface: paged attention over the KV cache for one mixed batch.

A forward pass calls ``prepare`` once (block tables → index tensors) and then ``forward`` once per
layer with that metadata. Keeping all host-side work in ``prepare`` is what a CUDA backend needs
too: its metadata would live in static device buffers that a captured CUDA graph replays, and its
``forward`` would call a paged kernel (Triton, FlashInfer) instead of gathering blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.rope import apply_rope


class AttentionBackend(ABC):
    def __init__(self, kv_cache: PagedKVCache, *, num_heads: int, num_kv_heads: int, head_dim: int):
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> object:
        """Index tensors for this batch, shared by every layer."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object
    ) -> torch.Tensor:
        """Writes the new tokens' k, v ([T, kv_heads, head_dim]) into the cache, then attends.

        q: [T, heads, head_dim]. Returns [T, heads, head_dim]: token t of entry i attends to its
        request's positions ``[0, start_pos[i] + t]``.
        """

    def forward_qkv(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """``forward`` from a fused projection: qkv [T, (heads + 2·kv_heads)·head_dim], its q and
        k heads not yet rotated (cos, signed_sin: RotaryEmbedding.cos_sin's). A backend may fuse
        the rotation with the cache write; this one rotates with torch."""
        rows, dim = qkv.shape[0], self.head_dim
        qk_size = (self.num_heads + self.num_kv_heads) * dim
        # q and k heads side by side: one rotation for both
        qk = apply_rope(qkv[:, :qk_size].view(rows, -1, dim), cos, signed_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(rows, self.num_kv_heads, dim)
        return self.forward(layer, q, k, v, metadata)
