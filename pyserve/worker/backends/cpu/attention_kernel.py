"""Paged attention on `pyserve._kernels`: the argument checks, then one C++ call.

Decode:
D single-token queries, each with its own block table and context length, attend to K and V read
in place from one layer's paged cache (V ``[kv_heads, num_blocks, block_size, head_dim]``, K
``[kv_heads, num_blocks, head_dim, block_size]``, see kv_cache.py): no gather copy. The kernel
accumulates in float32 with an online softmax and splits the work over (request, kv head) and,
for long contexts, over partitions of the context that it merges at the end
(cpp/kernels/attention.h).

Prefill: the chunks of several prompts ("spans" of consecutive rows), each row attending
causally to its request's cached tokens and to the rows of its chunk up to itself, again read in
place from the cache, which holds the chunk's own K/V already (cpp/kernels/prefill_attention.h).

Both take a sliding ``window`` (a query at position p sees positions p - window + 1 .. p, as
Hugging Face's sliding-window layers; 0: all) and a logit ``softcap`` (each scaled score s becomes
softcap · tanh(s / softcap) before the softmax, as Gemma 2's; 0: none). With a window, decode
reads only the window's blocks.

``paged_decode_attention`` and ``paged_prefill_attention`` check everything the kernels rely on
and raise ValueError. The CPU backend checks the cache and the tables once per forward and calls
``DecodeAttention.run`` / ``PrefillAttention.run`` per layer, which only check the query's
layout.
"""

from __future__ import annotations

import math

import torch

from pyserve.worker import quant
from pyserve.worker.dtypes import kv_int8_groups as int8_groups

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# what the cache may hold besides: int8 values with a float16 scale per 32 (kv_cache.py)
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 3}
INDEX_BYTES = {torch.int32: 4, torch.int64: 8}


def kernel_available() -> bool:
    """Whether the compiled module imports (it has a scalar path for any CPU)."""
    try:
        quant.kernels()
    except ImportError:
        return False
    return True


def attention_features() -> frozenset[str]:
    """What the compiled attention kernels compute beyond plain causal attention: "window"
    (a sliding window over the last W positions), "softcap" (scores → cap·tanh(s / cap)) and
    "sinks" (a logit per head in every softmax, with no value), as the module declares them
    (``pyserve._kernels.ATTENTION_FEATURES``)."""
    if not kernel_available():
        return frozenset()
    return frozenset(getattr(quant.kernels(), "ATTENTION_FEATURES", ()))


def _check_options(window: int, softcap: float, sinks: torch.Tensor | None, heads: int) -> int:
    """The sinks' address (0: none), once the options are checked."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), not {window}")
    if not (softcap >= 0 and math.isfinite(softcap)):  # NaN fails the comparison
        raise ValueError(f"softcap must be finite and >= 0 (0: none), not {softcap}")
    if sinks is None:
        return 0
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,) or not sinks.is_contiguous():
        raise ValueError(f"sinks must be a contiguous float32 [{heads}] tensor")
    return sinks.data_ptr()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, not {t.device}")
        if t.dtype not in CACHE_DTYPE_CODES:
            raise ValueError(f"{name} dtype {t.dtype} is not float32, bfloat16, float16 or int8")
        if t.dim() != 4 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 4-d tensor")
    if k_cache.shape != _k_shape(v_cache.shape) or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache must be [kv_heads, num_blocks, head_dim, block_size] for a v_cache of "
            "[kv_heads, num_blocks, block_size, head_dim], with the same dtype"
        )


def scale_addresses(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[int, int]:
    """The addresses of an int8 cache's K and V scales (0, 0 for a float cache), once checked:
    float16, contiguous, as kv_cache.py allocates them: K's [kv_heads, num_blocks, groups,
    block_size], V's [kv_heads, num_blocks, block_size, groups], a group per 32 values."""
    if k_cache.dtype != torch.int8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} cache has no scales")
        return 0, 0
    heads, blocks, dim, size = k_cache.shape
    groups = int8_groups(dim)
    shapes = {"k_scale": (heads, blocks, groups, size), "v_scale": (heads, blocks, size, groups)}
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"an int8 cache needs its {name}")
        shape = shapes[name]
        if t.dtype != torch.float16 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float16 {list(shape)} tensor")
    return k_scale.data_ptr(), v_scale.data_ptr()  # type: ignore[union-attr]


def _k_shape(v_shape: tuple[int, ...]) -> tuple[int, ...]:
    """K's shape for a V of [kv_heads, num_blocks, block_size, head_dim] (and back)."""
    return (*v_shape[:2], v_shape[3], v_shape[2])


def _check_index(name: str, t: torch.Tensor, dims: int, rows: int) -> None:
    if t.device.type != "cpu" or t.dtype not in INDEX_BYTES:
        raise ValueError(f"{name} must be an int32 or int64 CPU tensor, not {t.dtype} {t.device}")
    if t.dim() != dims or t.shape[0] != rows or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous with {dims} dims and {rows} rows")


class _BoundToCache:
    """A call's per-batch arguments bound to a cache geometry and checked once; ``_layer``
    checks what changes per layer (q, the caches, out) and gives q's and out's row strides."""

    def __init__(self, rows: int, num_heads: int, k_cache: torch.Tensor):
        kv_heads = k_cache.shape[0]
        if num_heads < 1 or num_heads % kv_heads:
            raise ValueError(f"{num_heads} query heads do not split into {kv_heads} kv heads")
        self.rows = rows
        self.num_heads = num_heads
        # kv_heads, num_blocks, block_size, head_dim: V's shape
        self.geometry = _k_shape(tuple(k_cache.shape))
        self._kernels = quant.kernels()

    def _layer(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
    ) -> tuple[int, int]:
        head_dim = self.geometry[3]
        shape = (self.rows, self.num_heads, head_dim)
        if q.dtype not in DTYPE_CODES or q.device.type != "cpu":
            raise ValueError(f"q must be a float32/bfloat16/float16 CPU tensor, not {q.dtype}")
        if q.shape != shape or q.stride()[1:] != (head_dim, 1):
            raise ValueError(
                f"q must be {list(shape)} with contiguous heads, got shape {tuple(q.shape)} "
                f"strides {q.stride()}"
            )
        if k_cache.shape != _k_shape(self.geometry) or v_cache.shape != self.geometry:
            raise ValueError(
                f"the caches must be {list(_k_shape(self.geometry))} and {list(self.geometry)}"
            )
        if out.shape != q.shape or out.dtype != q.dtype or out.stride()[1:] != (head_dim, 1):
            raise ValueError("out must have q's shape and dtype, with contiguous heads")
        row = self.num_heads * head_dim  # the stride of a single row does not matter
        return (q.stride(0), out.stride(0)) if self.rows > 1 else (row, row)


class DecodeAttention(_BoundToCache):
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
        positions: torch.Tensor | None = None,
    ):
        """``positions``: each query's own position, where its window ends, of context_lens'
        dtype (None: context - 1; a run of positions that attend to each other both ways reads
        past itself)."""
        num_queries = context_lens.shape[0] if context_lens.dim() == 1 else -1
        _check_index("context_lens", context_lens, 1, num_queries)
        if positions is not None:
            _check_index("positions", positions, 1, num_queries)
            if positions.dtype != context_lens.dtype:
                raise ValueError("positions must have context_lens' dtype")
        _check_index("block_tables", block_tables, 2, num_queries)
        super().__init__(num_queries, num_heads, k_cache)
        block_size = self.geometry[2]
        if partition_tokens < 0:
            raise ValueError(f"partition_tokens must be >= 0, not {partition_tokens}")
        if num_queries:
            if int(context_lens.min()) < 1:
                raise ValueError("every context length must be >= 1")
            if int(context_lens.max()) > block_tables.shape[1] * block_size:
                raise ValueError("a context is longer than its block table covers")
        self.block_tables = block_tables
        self.context_lens = context_lens
        self.positions = positions
        self.partition_tokens = partition_tokens

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [D, heads, head_dim] (rows may be strided) → out of q's shape and dtype; each query
        sees its context's last ``window`` positions (0: all), scores soft-capped at ``softcap``
        (0: none), each head's softmax with its ``sinks`` logit as one more column (float32
        [heads]; None: none); an int8 cache's ``k_scale`` and ``v_scale``."""
        sinks_at = _check_options(window, softcap, sinks, self.num_heads)
        k_scale_at, v_scale_at = scale_addresses(k_cache, k_scale, v_scale)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        q_stride, out_stride = self._layer(q, k_cache, v_cache, out)
        kv_heads, num_blocks, block_size, head_dim = self.geometry
        self._kernels.paged_decode_attention(
            q.data_ptr(),
            q_stride,
            DTYPE_CODES[q.dtype],
            self.rows,
            self.num_heads,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            CACHE_DTYPE_CODES[k_cache.dtype],
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
            out_stride,
            self.partition_tokens,
            window,
            softcap,
            sinks_at,
            0 if self.positions is None else self.positions.data_ptr(),
            k_scale_at,
            v_scale_at,
        )
        return out


class PrefillAttention(_BoundToCache):
    """One batch's prompt chunks bound to a cache geometry, checked once; ``run`` then attends
    for one layer.

    spans: int64 [S, 3], per chunk its first row in q, its rows and the tokens cached before it;
    block_tables: int32/int64 [S, width], each chunk's request's blocks.
    """

    def __init__(
        self,
        spans: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        num_rows: int,
        num_heads: int,
        k_cache: torch.Tensor,
    ):
        if spans.dtype != torch.int64 or spans.device.type != "cpu":
            raise ValueError(f"spans must be an int64 CPU tensor, not {spans.dtype} {spans.device}")
        if spans.dim() != 2 or spans.shape[1] != 3 or not spans.is_contiguous():
            raise ValueError("spans must be a contiguous [S, 3] tensor")
        _check_index("block_tables", block_tables, 2, spans.shape[0])
        super().__init__(num_rows, num_heads, k_cache)
        block_size = self.geometry[2]
        if len(spans):
            first, rows, start = spans.unbind(1)
            if int(rows.min()) < 1 or int(start.min()) < 0 or int(first.min()) < 0:
                raise ValueError("every span needs rows >= 1, start >= 0 and first row >= 0")
            if int((first + rows).max()) > num_rows:
                raise ValueError(f"a span reaches past the batch's {num_rows} rows")
            if int((start + rows).max()) > block_tables.shape[1] * block_size:
                raise ValueError("a span is longer than its block table covers")
        self.spans = spans
        self.block_tables = block_tables

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [rows, heads, head_dim] (rows may be strided) → the spans' rows of ``out`` (q's
        shape and dtype, contiguous heads); other rows of ``out`` are left as they are. Each row
        sees the last ``window`` positions up to its own (0: all), scores soft-capped at
        ``softcap`` (0: none), with the ``sinks`` and an int8 cache's scales as
        DecodeAttention.run's."""
        sinks_at = _check_options(window, softcap, sinks, self.num_heads)
        k_scale_at, v_scale_at = scale_addresses(k_cache, k_scale, v_scale)
        q_stride, out_stride = self._layer(q, k_cache, v_cache, out)
        kv_heads, num_blocks, block_size, head_dim = self.geometry
        self._kernels.paged_prefill_attention(
            q.data_ptr(),
            q_stride,
            DTYPE_CODES[q.dtype],
            self.rows,
            self.num_heads,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            CACHE_DTYPE_CODES[k_cache.dtype],
            kv_heads,
            num_blocks,
            block_size,
            head_dim,
            self.spans.data_ptr(),
            self.spans.shape[0],
            self.block_tables.data_ptr(),
            INDEX_BYTES[self.block_tables.dtype],
            self.block_tables.shape[1],
            scale,
            out.data_ptr(),
            out_stride,
            window,
            softcap,
            sinks_at,
            k_scale_at,
            v_scale_at,
        )
        return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prompt chunks over the paged cache (which already holds their K/V):
    row ``first + i`` of span (first, rows, start) sees its request's tokens [0, start + i]
    through ``block_tables[span]``, with a ``window`` only the last ``window`` of them, scores
    soft-capped at ``softcap`` (0: none), each head's ``sinks`` logit (float32 [heads]) one more
    softmax column; query head h reads kv head h // (heads // kv_heads). Returns ``out``
    ([rows, heads, head_dim] in q's dtype; new and zeroed when None), written at the spans'
    rows.
    """
    _check_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[2] != v_cache.shape[3]:
        raise ValueError(f"q's head_dim {q.shape[2]} is not the cache's {v_cache.shape[3]}")
    call = PrefillAttention(
        spans, block_tables, num_rows=q.shape[0], num_heads=q.shape[1], k_cache=k_cache
    )
    if out is None:
        out = torch.zeros(q.shape, dtype=q.dtype)
    return call.run(q, k_cache, v_cache, scale, out, window=window, softcap=softcap, sinks=sinks,
                    k_scale=k_scale, v_scale=v_scale)  # fmt: skip


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
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [D, heads, head_dim] (one token per request) over each request's first
    ``context_lens[d]`` cached tokens, found through ``block_tables[d]``, with a ``window`` only
    the last ``window`` of them (the blocks before are not read), scores soft-capped at
    ``softcap`` (0: none), each head's ``sinks`` logit (float32 [heads]) one more softmax
    column; query head h reads kv head h // (heads // kv_heads). Returns [D, heads, head_dim] in
    q's dtype.

    block_tables: int32/int64 [D, width]; context_lens: int32/int64 [D]. ``partition_tokens``
    forces the context split (0: the kernel picks it from the load and its thread count).
    ``positions`` (context_lens' dtype, [D]): each query's own position, where its window ends
    (None: context - 1). An int8 cache (K and V values as int8) comes with ``k_scale`` and
    ``v_scale``, float16, a scale per 32 values laid out as K and V are (kv_cache.py).
    """
    _check_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [D, heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[2] != v_cache.shape[3]:
        raise ValueError(f"q's head_dim {q.shape[2]} is not the cache's {v_cache.shape[3]}")
    if context_lens.dim() == 1 and context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{context_lens.shape[0]} context lengths for {q.shape[0]} queries")
    call = DecodeAttention(
        block_tables,
        context_lens,
        num_heads=q.shape[1],
        k_cache=k_cache,
        partition_tokens=partition_tokens,
        positions=positions,
    )
    return call.run(q, k_cache, v_cache, scale, out, window=window, softcap=softcap, sinks=sinks,
                    k_scale=k_scale, v_scale=v_scale)  # fmt: skip


__all__ = [
    "CACHE_DTYPE_CODES",
    "DTYPE_CODES",
    "DecodeAttention",
    "PrefillAttention",
    "attention_features",
    "kernel_available",
    "paged_decode_attention",
    "paged_prefill_attention",
]
