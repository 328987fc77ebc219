"""Paged decode attention on `pyserve._kernels`: the argument checks, then one C++ call.

D single-token queries, each with its own block table and context length, attend to K and V read
in place from one layer's paged cache (``[kv_heads, num_blocks, block_size, head_dim]``, see
kv_cache.py): no gather copy. The kernel accumulates in float32 with an online softmax and splits
the work over (request, kv head) and, for long contexts, over partitions of the context that it
merges at the end (cpp/kernels/attention.h).

``paged_decode_attention`` checks everything the kernel relies on and raises ValueError. The CPU
backend checks the cache and the tables once per forward and calls ``DecodeAttention.run`` per
layer, which only checks the query's layout.
"""

from __future__ import annotations

import torch

from pyserve.worker import quant

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
INDEX_BYTES = {torch.int32: 4, torch.int64: 8}


def kernel_available() -> bool:
    """Whether the compiled module imports (it has a scalar path for any CPU)."""
    try:
        quant.kernels()
    except ImportError:
        return False
    return True


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, not {t.device}")
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"{name} dtype {t.dtype} is not float32, bfloat16 or float16")
        if t.dim() != 4 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [kv_heads, num_blocks, block_size, head_dim] tensor"
            )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache differ in shape or dtype")


def _check_index(name: str, t: torch.Tensor, dims: int, rows: int) -> None:
    if t.device.type != "cpu" or t.dtype not in INDEX_BYTES:
        raise ValueError(f"{name} must be an int32 or int64 CPU tensor, not {t.dtype} {t.device}")
    if t.dim() != dims or t.shape[0] != rows or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous with {dims} dims and {rows} rows")


class DecodeAttention:
    """One batch's block tables and context lengths bound to a cache geometry, checked once;
    ``run`` then attends for one layer."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        num_heads: int,
        k_cache: torch.Tensor,
        partition_tokens: int = 0,
    ):
        num_queries = context_lens.shape[0] if context_lens.dim() == 1 else -1
        _check_index("context_lens", context_lens, 1, num_queries)
        _check_index("block_tables", block_tables, 2, num_queries)
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        if num_heads < 1 or num_heads % kv_heads:
            raise ValueError(f"{num_heads} query heads do not split into {kv_heads} kv heads")
        if partition_tokens < 0:
            raise ValueError(f"partition_tokens must be >= 0, not {partition_tokens}")
        if num_queries:
            if int(context_lens.min()) < 1:
                raise ValueError("every context length must be >= 1")
            if int(context_lens.max()) > block_tables.shape[1] * block_size:
                raise ValueError("a context is longer than its block table covers")
        self.block_tables = block_tables
        self.context_lens = context_lens
        self.num_queries = num_queries
        self.num_heads = num_heads
        self.geometry = (kv_heads, num_blocks, block_size, head_dim)
        self.partition_tokens = partition_tokens
        self._kernels = quant.kernels()

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [D, heads, head_dim] (rows may be strided) → out of q's shape and dtype."""
        kv_heads, num_blocks, block_size, head_dim = self.geometry
        row = self.num_heads * head_dim
        if q.dtype not in DTYPE_CODES or q.device.type != "cpu":
            raise ValueError(f"q must be a float32/bfloat16/float16 CPU tensor, not {q.dtype}")
        if q.shape != (self.num_queries, self.num_heads, head_dim) or q.stride()[1:] != (
            head_dim,
            1,
        ):
            raise ValueError(
                f"q must be [{self.num_queries}, {self.num_heads}, {head_dim}] with contiguous "
                f"heads, got shape {tuple(q.shape)} strides {q.stride()}"
            )
        if k_cache.shape != self.geometry or v_cache.shape != self.geometry:
            raise ValueError(f"the caches must be {list(self.geometry)}")
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        elif out.shape != q.shape or out.dtype != q.dtype or out.stride()[1:] != (head_dim, 1):
            raise ValueError("out must have q's shape and dtype, with contiguous heads")
        self._kernels.paged_decode_attention(
            q.data_ptr(),
            q.stride(0) if self.num_queries > 1 else row,
            DTYPE_CODES[q.dtype],
            self.num_queries,
            self.num_heads,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            DTYPE_CODES[k_cache.dtype],
            kv_heads,
            num_blocks,
            block_size,
            head_dim,
            self.block_tables.data_ptr(),
            INDEX_BYTES[self.block_tables.dtype],
            self.block_tables.shape[1],
            self.context_lens.data_ptr(),
            INDEX_BYTES[self.context_lens.dtype],
            scale,
            out.data_ptr(),
            out.stride(0) if self.num_queries > 1 else row,
            self.partition_tokens,
        )
        return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    partition_tokens: int = 0,
) -> torch.Tensor:
    """Attention of q [D, heads, head_dim] (one token per request) over each request's first
    ``context_lens[d]`` cached tokens, found through ``block_tables[d]``; query head h reads kv
    head h // (heads // kv_heads). Returns [D, heads, head_dim] in q's dtype.

    block_tables: int32/int64 [D, width]; context_lens: int32/int64 [D]. ``partition_tokens``
    forces the context split (0: the kernel picks it from the load and its thread count).
    """
    _check_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [D, heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q's head_dim {q.shape[2]} is not the cache's {k_cache.shape[3]}")
    if context_lens.dim() == 1 and context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{context_lens.shape[0]} context lengths for {q.shape[0]} queries")
    call = DecodeAttention(
        block_tables,
        context_lens,
        num_heads=q.shape[1],
        k_cache=k_cache,
        partition_tokens=partition_tokens,
    )
    return call.run(q, k_cache, v_cache, scale, out)


__all__ = ["DTYPE_CODES", "DecodeAttention", "kernel_available", "paged_decode_attention"]
