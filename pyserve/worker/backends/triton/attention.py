"""Paged attention in Triton: decode (split-K over long contexts, GQA) and prefill/extend over
cached prefixes, with sliding windows and soft-capping.

The KV cache (``FlatKVCache``) is ``[num_blocks * block_size, kv_heads, head_dim]`` per layer
for K and for V: a token's slot is ``block * block_size + offset``, and one kv head of a block of
tokens is a strided tile that ``tl.load`` reads directly. Both kernels read every key from the
cache: the new tokens' K/V are stored first (``rope_kv_store``), so a prompt gives the same
result however it is split into chunks. Scores, the softmax and the sums run in float32.

An int8 cache (``--kv-cache-dtype int8``) is read in place, never dequantized to a float copy.
Its float16 scales (``[slots, kv_heads, groups]`` beside the cache, a scale per 32 values of a
head: kv_int8.py) are applied in two parts: in registers, each group's values times its scale
over the token's largest one (within ±127 in the dot's dtype, so float16 neither overflows nor
drops small groups to subnormals; integers, exact, where a head is one group), and that largest
scale where it costs one multiply per score: a key's to its column of scores, a value's to its
column of softmax weights.

Decode: a program takes one request, one kv head and one split of its context; it scores all
the query heads of that kv head's group at once (padded to 16 rows, what ``tl.dot`` needs), and
writes its partial output with the log-sum-exp of its weights; a second kernel merges the splits.
Extend: a program takes BLOCK_M query rows of one head of one prefill entry and walks the keys
from the window's start to its last row's position, causally masked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from pyserve.worker.backends.triton import dot_precision
from pyserve.worker.backends.triton.kv_int8 import check_int8_scales, int8_block_groups
from pyserve.worker.dtypes import kv_int8_groups

if TYPE_CHECKING:
    import torch

# jit code reads module globals only when they are constexprs (the interpreter reads any)
_NEG_INF = tl.constexpr(float("-inf"))
_INT8_MAX = tl.constexpr(127.0)


@triton.jit
def _softcapped(scores, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # tanh(x) = 2·sigmoid(2x) − 1: tl has no tanh that the interpreter and every GPU share
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
    return scores


@triton.jit
def _slots(table_row_ptr, positions, valid, BLOCK_SIZE: tl.constexpr):
    """The cache slots (int64) of these positions of a request."""
    block = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=valid, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE


@triton.jit
def _kv_tile(
    cache_ptr, slots, valid, kv_head, dims, dim_ok,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The [len(slots), BLOCK_D] tile of one kv head at these slots, as the cache holds it."""
    offsets = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
    return tl.load(cache_ptr + offsets, mask=valid[:, None] & dim_ok[None, :], other=0.0)


@triton.jit
def _int8_tile(
    cache_ptr, scale_ptr, slots, valid, kv_head, dims, dtype: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """An int8 cache's tile [len(slots), len(dims)] of one kv head at these slots (dims: the
    tile's, 0 to BLOCK_D), in ``dtype``, with each token's
    largest group scale s_max [len(slots)] (0 for an all-zero token or where not valid): each
    group's values times its scale over s_max, so that the tile times s_max is the dequantized
    one. Relative to s_max the values stay within ±127, where no dtype overflows or loses a
    small group's values to subnormals; a token whose groups share one scale (a head of up to
    32 dims) stays integer, exact in any dtype."""
    rows: tl.constexpr = slots.shape[0]
    width: tl.constexpr = dims.shape[0] // BLOCK_G
    groups = tl.arange(0, BLOCK_G)
    row_at = slots * NUM_KV_HEADS + kv_head
    ok = valid[:, None] & (groups[None, :] < GROUPS)
    scales = tl.load(scale_ptr + row_at[:, None] * GROUPS + groups[None, :], mask=ok, other=0.0)
    scales = scales.to(tl.float32)
    largest = tl.max(scales, axis=1)
    relative = tl.math.div_rn(scales, tl.where(largest > 0, largest, 1.0)[:, None])
    # the tile as [N, BLOCK_G, width]: each group's ratio broadcasts over its dims in place
    in_group = tl.arange(0, width)
    group_dims = groups[:, None] * width + in_group[None, :]
    at = row_at[:, None, None] * HEAD_DIM + group_dims[None, :, :]
    ok3 = valid[:, None, None] & (group_dims < HEAD_DIM)[None, :, :]
    tile = tl.load(cache_ptr + at, mask=ok3, other=0.0)
    # int8 by way of float32, as Triton's interpreter casts int8 to bfloat16 wrongly
    tile = tl.reshape(tile.to(tl.float32) * relative[:, :, None], (rows, BLOCK_G * width))
    return tile.to(dtype), largest


@triton.jit
def _scores(
    q, k_ptr, k_scale_ptr, slots, valid, kv_head, dims, dim_ok, scale, softcap,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    QUANTIZED: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Scaled (and soft-capped) scores [rows of q, len(slots)] against the keys at these slots;
    int8 keys relative to each key's largest group scale (``_int8_tile``), which multiplies its
    column of scores."""
    if QUANTIZED:
        k, largest = _int8_tile(
            k_ptr, k_scale_ptr, slots, valid, kv_head, dims, q.dtype, NUM_KV_HEADS, HEAD_DIM,
            GROUPS, BLOCK_G,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (largest * scale)[None, :]
    else:
        k = _kv_tile(k_ptr, slots, valid, kv_head, dims, dim_ok, NUM_KV_HEADS, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
    return _softcapped(scores, softcap, HAS_SOFTCAP)


@triton.jit
def _values(
    v_ptr, v_scale_ptr, slots, valid, kv_head, dims, dim_ok, dtype: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr,
    GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """The value tile at these slots in ``dtype`` and what each token's weight is multiplied by:
    for int8 values (relative to the token's largest group scale s_max: ``_int8_tile``), s_max
    times 127 (about its largest |v|), so that float16 weights stay out of float16's subnormal
    range; ``_finished`` divides the 127 out. 1 for float values."""
    if QUANTIZED:
        v, largest = _int8_tile(
            v_ptr, v_scale_ptr, slots, valid, kv_head, dims, dtype, NUM_KV_HEADS, HEAD_DIM,
            GROUPS, BLOCK_G,
        )  # fmt: skip
        factor = largest * _INT8_MAX
    else:
        v = _kv_tile(v_ptr, slots, valid, kv_head, dims, dim_ok, NUM_KV_HEADS, HEAD_DIM)
        v = v.to(dtype)
        factor = tl.full([1], 1.0, dtype=tl.float32)
    return v, factor


@triton.jit
def _accumulate(
    scores, v, factor, best, total, acc, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr
):
    """One tile of the online softmax: scores [R, N] (-inf where unseen), v [N, D] with each
    token's factor [N] (``_values``); returns the running (max, sum of weights, weighted sum of
    values) of each row."""
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    # a row that has seen nothing yet keeps -inf: shift it by 0 so that exp gives 0, not NaN
    shift = tl.where(new_best == _NEG_INF, 0.0, new_best)
    weights = tl.exp(scores - shift[:, None])
    rescale = tl.exp(best - shift)
    total = total * rescale + tl.sum(weights, axis=1)
    if QUANTIZED:
        weights = weights * factor[None, :]
    acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
    return new_best, total, acc


@triton.jit
def _finished(acc, total, QUANTIZED: tl.constexpr):
    """The weighted mean of the values (0 for a row that saw none)."""
    if QUANTIZED:
        acc = acc / _INT8_MAX
    return acc / tl.maximum(total, 1e-30)[:, None]


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, context_ptr, rows_ptr, out_ptr,
    lse_ptr, q_row_stride, table_stride, scale, softcap, window, split_tokens_ptr, positions_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    QUANTIZED: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    entry = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + entry).to(tl.int64)  # the query's row in the batch
    context = tl.load(context_ptr + entry)  # positions it attends to, its own included
    # read from the device: a captured graph replays with the split its step's contexts need
    split_tokens = tl.load(split_tokens_ptr)
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, context)
    if HAS_WINDOW:
        # the window ends at the query's own position: the context's last, unless the query is
        # in a run that reads past itself (Gemma 3's images)
        if HAS_POSITIONS:
            lo = tl.maximum(lo, tl.load(positions_ptr + entry) - window + 1)
        else:
            lo = tl.maximum(lo, context - window)

    group = tl.arange(0, BLOCK_H)
    group_ok = group < GROUP
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + row * q_row_stride + heads[:, None] * HEAD_DIM + dims[None, :],
        mask=group_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    table = tables_ptr + entry.to(tl.int64) * table_stride
    best = tl.full([BLOCK_H], _NEG_INF, dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < hi
        slots = _slots(table, positions, valid, BLOCK_SIZE)
        scores = _scores(
            q, k_ptr, k_scale_ptr, slots, valid, kv_head, dims, dim_ok, scale, softcap,
            NUM_KV_HEADS, HEAD_DIM, HAS_SOFTCAP, QUANTIZED, GROUPS, BLOCK_G, PRECISION,
        )  # fmt: skip
        scores = tl.where(valid[None, :], scores, _NEG_INF)
        v, factor = _values(
            v_ptr, v_scale_ptr, slots, valid, kv_head, dims, dim_ok, q.dtype, NUM_KV_HEADS,
            HEAD_DIM, QUANTIZED, GROUPS, BLOCK_G,
        )  # fmt: skip
        best, total, acc = _accumulate(scores, v, factor, best, total, acc, QUANTIZED, PRECISION)
    # a split with no positions (past the context, or before the window) has total 0
    out = _finished(acc, total, QUANTIZED)
    lse = tl.where(total > 0, best + tl.log(tl.maximum(total, 1e-30)), _NEG_INF)
    part = (entry.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(
        out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        out,
        mask=group_ok[:, None] & dim_ok[None, :],
    )
    tl.store(lse_ptr + part, lse, mask=group_ok)


@triton.jit
def _decode_merge_kernel(
    parts_ptr, lse_ptr, rows_ptr, o_ptr, o_row_stride, sinks_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    entry = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + entry).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part = (entry.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(lse_ptr + part, mask=split_ok, other=_NEG_INF)
    best = tl.max(lse, axis=0)  # finite: every row has at least its own position
    if HAS_SINKS:  # the sink: one more column in the softmax, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        best = tl.maximum(best, sink)
    weights = tl.exp(lse - best)
    parts = tl.load(
        parts_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    denominator = tl.sum(weights, axis=0)
    if HAS_SINKS:
        denominator += tl.exp(sink - best)
    out = tl.sum(parts * weights[:, None], axis=0) / denominator
    tl.store(o_ptr + row * o_row_stride + head * HEAD_DIM + dims, out, mask=dim_ok)


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, o_ptr, tables_ptr, q_start_ptr, q_len_ptr,
    prefix_ptr, q_row_stride, o_row_stride, table_stride, scale, softcap, window, sinks_ptr,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, QUANTIZED: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    entry = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_len = tl.load(q_len_ptr + entry)
    if m_block * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + entry).to(tl.int64)
    prefix = tl.load(prefix_ptr + entry)  # positions cached before this chunk
    kv_head = head // GROUP

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    query_pos = prefix + rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * q_row_stride + head * HEAD_DIM + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    table = tables_ptr + entry.to(tl.int64) * table_stride
    hi = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len)  # past the block's last row
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0)
    best = tl.full([BLOCK_M], _NEG_INF, dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink's column first: its logit, weight exp(0), no value
        best = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head).to(tl.float32)
        total += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < hi
        slots = _slots(table, positions, valid, BLOCK_SIZE)
        scores = _scores(
            q, k_ptr, k_scale_ptr, slots, valid, kv_head, dims, dim_ok, scale, softcap,
            NUM_KV_HEADS, HEAD_DIM, HAS_SOFTCAP, QUANTIZED, GROUPS, BLOCK_G, PRECISION,
        )  # fmt: skip
        seen = valid[None, :] & (positions[None, :] <= query_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (positions[None, :] > query_pos[:, None] - window)
        scores = tl.where(seen, scores, _NEG_INF)
        v, factor = _values(
            v_ptr, v_scale_ptr, slots, valid, kv_head, dims, dim_ok, q.dtype, NUM_KV_HEADS,
            HEAD_DIM, QUANTIZED, GROUPS, BLOCK_G,
        )  # fmt: skip
        best, total, acc = _accumulate(scores, v, factor, best, total, acc, QUANTIZED, PRECISION)
    out = _finished(acc, total, QUANTIZED)
    tl.store(
        o_ptr + (q_start + rows)[:, None] * o_row_stride + head * HEAD_DIM + dims[None, :],
        out,
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def decode_tiles(head_dim: int, int8_exact: bool = False) -> tuple[int, int]:
    """(keys a step, warps) of the decode kernel: no register spills at sm_90 for head dims up
    to 256 (tests/test_triton_compile.py checks; 64 keys of 128 dims spilled); over int8 K/V in
    float32 (``int8_exact``) fewer keys: int8_exact_keys."""
    block_d = _pow2(head_dim)
    block_n = 64 if block_d <= 64 else 32 if block_d <= 128 else 16
    if int8_exact:
        block_n = min(block_n, int8_exact_keys(block_d))
    return block_n, 4


def int8_exact_keys(block_d: int) -> int:
    """Keys a step of an attention kernel over int8 K/V in float32: its tiles, scaled in
    registers, feed a float32 dot (FMA, no tensor cores) in whose operand layout each value is
    held by many threads, so a tile of more than 1024 values spills on sm_90 (16 keys of 128
    dims did; 8 use 72 registers; at 256 dims even 8 keys spill). A power of two that divides
    the float tiles' key counts, so that decode splits (multiples of those) stay whole steps."""
    return max(8, 1024 // block_d)


def extend_tiles(head_dim: int, exact: bool = False, int8_kv: bool = False) -> tuple[int, int]:
    """(keys a step, warps) of the extend kernel, likewise: 8 warps from 128 dims on, and in
    float32 (``exact``) half the keys and always 8 warps; over int8 K/V (with int8_kv_options'
    stages) twice the keys at 256 dims, which spill less there, and in float32 int8_exact_keys
    with 4 warps."""
    block_d = _pow2(head_dim)
    block_n = 64 if block_d <= 128 else (32 if int8_kv else 16)
    if exact:
        if int8_kv:  # 4 warps: 8 at 8 keys of 80 dims spilled
            return min(block_n // 2, int8_exact_keys(block_d)), 4
        return block_n // 2, 8
    return block_n, (8 if block_d >= 128 else 4)


def int8_kv_options(exact: bool, decode: bool) -> dict[str, int]:
    """The launch options (software-pipeline stages) of an attention kernel over int8 K/V: its
    tiles are converted before the dot, so the pipeline prefetches them into registers rather
    than shared memory, and Triton's default stages spill on sm_90 in the extend kernel and in
    float32 (``exact``), whose converted tiles are twice the size (tests/test_triton_compile.py)."""
    if exact:
        return {"num_stages": 1}
    return {} if decode else {"num_stages": 2}


def decode_split_tokens(max_context: int, num_splits: int, head_dim: int) -> int:
    """Positions each of ``num_splits`` splits covers for contexts up to ``max_context``: whole
    steps of the decode kernel."""
    return _split_tokens(max_context, num_splits, decode_tiles(head_dim)[0])


def _split_tokens(max_context: int, num_splits: int, block_n: int) -> int:
    per_split = -(-max_context // num_splits)
    return -(-per_split // block_n) * block_n


def _int8_cache(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the cache holds int8 K/V (then with float16 scales [slots, kv_heads, groups])."""
    import torch

    quantized = k_cache.dtype == torch.int8
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"K is {k_cache.dtype} and V {v_cache.dtype}")
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError("scales come with an int8 cache only")
        return False
    check_int8_scales(k_cache, k_scale, v_scale)
    return True


def _int8_constexprs(head_dim: int, block_d: int) -> dict[str, int]:
    """The kernels' GROUPS (a head's scales) and BLOCK_G (a BLOCK_D tile's)."""
    return {"GROUPS": kv_int8_groups(head_dim), "BLOCK_G": int8_block_groups(block_d)}


def paged_decode_attention(
    q, k_cache, v_cache, out, tables, context, rows, *, max_context: int, block_size: int,
    num_kv_heads: int, scale: float, softcap: float | None, window: int | None,
    num_splits: int, block_n: int | None = None, split_tokens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Decode attention of the rows ``rows`` of q [T, heads, dim] into the same rows of out.

    tables: int32 [D, W] block tables; context: int32 [D] positions each attends to (its own
    included, at most ``max_context``); ``num_splits`` splits of the longest context are
    computed apart and merged. ``split_tokens``: int32 [1] on the device, the positions a
    split covers (None: decode_split_tokens of ``max_context``; a multiple of ``block_n``).
    ``sinks``: float32 [heads], each head's sink logit (None: no sinks). ``positions``: int32
    [D], each query's own position, where its window ends (None: context - 1). An int8 cache
    comes with its float16 scales ``k_scale``, ``v_scale`` [slots, kv_heads, groups].
    """
    import torch

    quantized = _int8_cache(k_cache, v_cache, k_scale, v_scale)
    num_rows, num_heads, head_dim = rows.shape[0], q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    precision = dot_precision(q.dtype)
    chosen, num_warps = decode_tiles(head_dim, int8_exact=quantized and precision == "ieee")
    block_n = block_n or chosen
    if split_tokens is None:
        split = _split_tokens(max_context, num_splits, block_n)
        split_tokens = torch.tensor([split], dtype=torch.int32, device=q.device)
    parts = torch.empty(
        num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = _pow2(head_dim)
    options = int8_kv_options(precision == "ieee", decode=True) if quantized else {}
    _decode_split_kernel[(num_rows, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if quantized else k_cache,
        v_scale if quantized else v_cache, tables, context, rows, parts, lse,
        q.stride(0), tables.stride(0), scale, softcap or 1.0, window or 0, split_tokens,
        context if positions is None else positions,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, BLOCK_H=_pow2(group), BLOCK_D=block_d,
        BLOCK_N=block_n, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        HAS_POSITIONS=positions is not None, QUANTIZED=quantized, PRECISION=precision,
        num_warps=num_warps, **_int8_constexprs(head_dim, block_d), **options,
    )  # fmt: skip
    _decode_merge_kernel[(num_rows, num_heads)](
        parts, lse, rows, out, out.stride(0), lse if sinks is None else sinks,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_S=_pow2(num_splits, floor=2), BLOCK_D=block_d, HAS_SINKS=sinks is not None,
    )  # fmt: skip


def paged_extend_attention(
    q, k_cache, v_cache, out, tables, q_start, q_len, prefix, *, max_q_len: int,
    block_size: int, num_kv_heads: int, scale: float, softcap: float | None,
    window: int | None, block_m: int = 32, block_n: int | None = None,
    sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Causal attention of each prefill entry's rows (``q_start``/``q_len`` [E]) over its cached
    prefix (``prefix`` positions) and itself, every key read from the cache via ``tables``;
    ``sinks`` and an int8 cache's ``k_scale``, ``v_scale`` as paged_decode_attention's."""
    quantized = _int8_cache(k_cache, v_cache, k_scale, v_scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    exact = dot_precision(q.dtype) == "ieee"
    chosen, num_warps = extend_tiles(head_dim, exact=exact, int8_kv=quantized)
    options = int8_kv_options(exact, decode=False) if quantized else {}
    block_n = block_n or chosen
    block_d = _pow2(head_dim)
    grid = (q_len.shape[0], num_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, k_scale if quantized else k_cache,
        v_scale if quantized else v_cache, out, tables, q_start, q_len, prefix,
        q.stride(0), out.stride(0), tables.stride(0), scale, softcap or 1.0, window or 0,
        q if sinks is None else sinks,
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, QUANTIZED=quantized, PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, **_int8_constexprs(head_dim, block_d), **options,
    )  # fmt: skip
