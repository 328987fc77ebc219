"""The paged prefill-attention kernel (pyserve._kernels via backends/cpu/attention_kernel.py).

Against a float64 reference that gathers each request's blocks and applies the lower-right causal
mask: several chunks in one call, with and without a cached prefix (starts crossing block and
16-row tile boundaries), chunks of 1 to 300 rows, GQA ratios 1/3/4, head_dim 64/128 and 40 (the
generic loops), block sizes 16 and 5 (key tiles cut by block ends), float32 / bfloat16 / float16
caches, every instruction set this CPU runs, 1 and 2 threads. Then: the same bits whatever the
thread count, rows outside the chunks untouched, and bad arguments raise ValueError.
"""

from __future__ import annotations

import functools

import pytest
import torch
from worker_testlib import assert_attention_close

from pyserve.worker import quant
from pyserve.worker.backends.cpu.attention_kernel import PrefillAttention, paged_prefill_attention

torch.set_num_threads(2)
KERNELS = quant.kernels()
THREADS = KERNELS.num_threads()

NUM_BLOCKS = 300
# (start, rows) of each chunk, laid out one after another in q with a gap row between some
CHUNKS = [(0, 37), (300, 1), (16, 16), (5, 300), (0, 1), (113, 49)]
SHAPES = [(64, 9, 3), (128, 4, 4), (64, 8, 2), (40, 3, 1)]


def layout(chunks: list[tuple[int, int]]) -> torch.Tensor:
    """spans [S, 3]: first row, rows, start; one unused row after every other chunk."""
    spans, row = [], 0
    for i, (start, rows) in enumerate(chunks):
        spans.append((row, rows, start))
        row += rows + i % 2
    return torch.tensor(spans, dtype=torch.int64)


def random_case(shape, dtype, block, seed, index_dtype=torch.int64):
    dim, heads, kv_heads = shape
    g = torch.Generator().manual_seed(seed)
    cache_shape = (kv_heads, NUM_BLOCKS, block, dim)
    k_cache = (torch.randn(cache_shape, generator=g) * 2).to(dtype)  # peaked softmaxes
    v_cache = torch.randn(cache_shape, generator=g).to(dtype)
    k_cache = k_cache.transpose(2, 3).contiguous()  # K is dimension-major within a block
    spans = layout(CHUNKS)
    width = max(-(-(s + n) // block) for s, n in CHUNKS) + 1
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in CHUNKS])
    num_rows = int((spans[:, 0] + spans[:, 1]).max()) + 1
    q = torch.randn(num_rows, heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, spans, tables.to(index_dtype)


def reference(
    q, k_cache, v_cache, spans, tables, scale, window=0, softcap=0.0, sinks=None
) -> torch.Tensor:
    """float64; rows outside the spans are NaN (the kernel must leave them alone). With a window
    row i of a span sees the last `window` positions up to its own, start + i; with a softcap
    the scores are capped before the mask; ``sinks`` [H]: one more softmax column per head,
    with no value."""
    heads, kv_heads, block = q.shape[1], v_cache.shape[0], v_cache.shape[2]
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for s, (first, rows, start) in enumerate(spans.tolist()):
        total = start + rows
        blocks = tables[s, : -(-total // block)].long()
        k = k_cache.index_select(1, blocks).transpose(2, 3).flatten(1, 2)[:, :total].double()
        v = v_cache.index_select(1, blocks).flatten(1, 2)[:, :total].double()
        k = k.repeat_interleave(heads // kv_heads, dim=0)  # [H, total, dim]
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        qs = q[first : first + rows].double().transpose(0, 1)  # [H, rows, dim]
        scores = qs @ k.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        visible = torch.ones(rows, total, dtype=torch.bool).tril(diagonal=start)
        if window:  # key j, row i: j > start + i - window
            visible &= torch.ones(rows, total, dtype=torch.bool).triu(diagonal=start - window + 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            column = sinks.double()[:, None, None].expand(heads, rows, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        # (the V rows nobody sees may hold NaN: 0 · NaN would spread it)
        out[first : first + rows] = (probs @ v.nan_to_num()).transpose(0, 1)
    return out


def assert_close(out, expected, dtype, what):
    """The rows the reference computed (not NaN) against the kernel's."""
    rows = ~expected[:, 0, 0].isnan()
    assert_attention_close(out[rows], expected[rows], dtype, what)


@functools.cache
def reference_case(dtype, shape, block):
    seed = sum(shape) + block
    index_dtype = torch.int32 if shape[0] == 64 else torch.int64
    q, k_cache, v_cache, spans, tables = random_case(shape, dtype, block, seed, index_dtype)
    expected = reference(q, k_cache, v_cache, spans, tables, shape[0] ** -0.5)
    return q, k_cache, v_cache, spans, tables, expected


@pytest.mark.parametrize("block", [16, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"dim{s[0]}-h{s[1]}-kv{s[2]}")
def test_matches_reference(isa, threads, dtype, shape, block):
    q, k_cache, v_cache, spans, tables, expected = reference_case(dtype, shape, block)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    result = paged_prefill_attention(q, k_cache, v_cache, spans, tables, shape[0] ** -0.5, out=out)
    assert result is out
    gap = expected[:, 0, 0].isnan()
    assert out[gap].isnan().all(), "a row outside the chunks was written"
    assert_close(out, expected, dtype, f"{isa} {dtype} block={block}")


def test_strided_float32_queries_over_a_float16_cache():
    """q as the model passes it: a view of the q|k heads of the rotated projection."""
    dim, heads, kv_heads = 64, 9, 3
    q, k_cache, v_cache, spans, tables = random_case((dim, heads, kv_heads), torch.float16, 16, 3)
    qk = torch.randn(q.shape[0], heads + kv_heads, dim)
    q = qk[:, :heads]
    out = paged_prefill_attention(q, k_cache, v_cache, spans, tables, 0.125)
    expected = reference(q, k_cache, v_cache, spans, tables, 0.125)
    assert_close(out, expected, torch.float32, "strided")


def test_same_bits_whatever_the_thread_count():
    q, k_cache, v_cache, spans, tables = random_case((64, 9, 3), torch.float32, 16, 11)
    results = []
    try:
        for n in (1, 2, 3):
            KERNELS.set_num_threads(n)
            results.append(paged_prefill_attention(q, k_cache, v_cache, spans, tables, 0.125))
    finally:
        KERNELS.set_num_threads(THREADS)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_bad_arguments_raise_value_error():
    q, k_cache, v_cache, spans, tables = random_case((64, 6, 2), torch.float32, 16, 13)
    rows = q.shape[0]

    def call(**changes):
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, spans=spans, block_tables=tables)
        args.update(changes)
        return paged_prefill_attention(scale=0.125, **args)

    call()  # the unchanged arguments are fine
    wide = tables.shape[1] * 16
    bad = {
        "q of ints": dict(q=q.int()),
        "q head_dim": dict(q=torch.randn(rows, 6, 32)),
        "q heads not a multiple": dict(q=torch.randn(rows, 5, 64)),
        "q heads strided": dict(q=torch.randn(rows, 64, 6).transpose(1, 2)),
        "cache dtype mismatch": dict(v_cache=v_cache.double()),
        "int32 spans": dict(spans=spans.int()),
        "spans of 2 columns": dict(spans=spans[:, :2].contiguous()),
        "zero rows": dict(spans=torch.tensor([[0, 0, 0]])),
        "negative start": dict(spans=torch.tensor([[0, 3, -1]])),
        "past q's rows": dict(spans=torch.tensor([[rows - 2, 3, 0]])),
        "past the table": dict(spans=torch.tensor([[0, 2, wide - 1]])),
        "table rows": dict(block_tables=tables[:1]),
        "float table": dict(block_tables=tables.float()),
        "block id too large": dict(block_tables=torch.full_like(tables, 300)),
        "negative block id": dict(block_tables=torch.full_like(tables, -1)),
    }
    for what, changes in bad.items():
        if "spans" in changes and changes["spans"].shape[0] == 1:
            changes.setdefault("block_tables", tables[:1])
        with pytest.raises(ValueError):
            call(**changes)
            pytest.fail(what)
    call_once = PrefillAttention(spans, tables, num_rows=rows, num_heads=6, k_cache=k_cache)
    with pytest.raises(ValueError):  # a layer whose cache has another geometry
        call_once.run(q, k_cache[:, :10].contiguous(), v_cache[:, :10].contiguous(), 0.125,
                      torch.empty_like(q))  # fmt: skip


# ------------------------------------------------------------------ sliding window and soft-cap

# (window, softcap) against CHUNKS (starts 0 … 300, up to 305 positions): a window of one
# position, shorter than a 16-row work item, a block, mid-block, longer than some chunks and
# than all; the cap alone and with a window
EXTRAS = [(1, 0.0), (7, 0.0), (16, 0.0), (40, 0.0), (100, 0.0), (1000, 0.0), (0, 2.0), (50, 2.0)]
EXTRA_SHAPES = [(64, 9, 3), (128, 4, 4), (40, 3, 1)]


@functools.cache
def extras_reference(dtype, shape, block, window, softcap):
    q, k_cache, v_cache, spans, tables, _ = reference_case(dtype, shape, block)
    return reference(q, k_cache, v_cache, spans, tables, shape[0] ** -0.5, window, softcap)


@pytest.mark.parametrize("block", [16, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", EXTRA_SHAPES, ids=lambda s: f"dim{s[0]}-h{s[1]}-kv{s[2]}")
def test_window_and_softcap_match_reference(isa, dtype, shape, block):
    q, k_cache, v_cache, spans, tables, plain = reference_case(dtype, shape, block)
    rows = ~plain[:, 0, 0].isnan()
    for window, softcap in EXTRAS:
        expected = extras_reference(dtype, shape, block, window, softcap)
        if window < 300:  # the feature changes the answer well beyond the tolerance
            assert (expected[rows] - plain[rows]).abs().max() > 0.05
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        paged_prefill_attention(q, k_cache, v_cache, spans, tables, shape[0] ** -0.5, out=out,
                                window=window, softcap=softcap)  # fmt: skip
        assert out[~rows].isnan().all(), "a row outside the chunks was written"
        assert_close(out, expected, dtype, f"{isa} {dtype} block={block} {window=} {softcap=}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 40])
def test_sinks_match_reference(isa, dtype, window):
    """A sink logit per head (gpt-oss), strong and weak against the scores, alone and with a
    window: one more column in every row's softmax."""
    shape, block = (64, 9, 3), 16
    q, k_cache, v_cache, spans, tables, plain = reference_case(dtype, shape, block)
    rows = ~plain[:, 0, 0].isnan()
    sinks = torch.linspace(-4.0, 6.0, shape[1])
    expected = reference(q, k_cache, v_cache, spans, tables, shape[0] ** -0.5, window, sinks=sinks)
    assert (expected[rows] - plain[rows]).abs().max() > 0.05
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    paged_prefill_attention(q, k_cache, v_cache, spans, tables, shape[0] ** -0.5, out=out,
                            window=window, sinks=sinks)  # fmt: skip
    assert_close(out, expected, dtype, f"{isa} {dtype} {window=} sinks")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_reads_nothing_before_it_and_counts_its_first_position(isa, threads, dtype):
    """Chunks after cached prefixes: the positions before their first row's window hold NaN in K
    and V (any read of one would show, masked or not), and V is 50 at the first position of every
    row's window, which a window one short would leave out. Chunks own disjoint blocks."""
    dim, heads, kv_heads, block, num_blocks = 64, 9, 3, 16, 200
    chunks = [(300, 40), (130, 1), (21, 17), (0, 50), (77, 33)]  # (start, rows)
    spans = layout(chunks)
    g = torch.Generator().manual_seed(31)
    widths = [-(-(s + n) // block) for s, n in chunks]
    ids = torch.randperm(num_blocks, generator=g)[: sum(widths)].split(widths)
    tables = torch.stack([torch.cat((i, i.new_zeros(max(widths) - len(i)))) for i in ids])
    num_rows = int((spans[:, 0] + spans[:, 1]).max())
    q = torch.randn(num_rows, heads, dim, generator=g).to(dtype)
    for window in (20, 64, 33):
        k = torch.randn(kv_heads, num_blocks, block, dim, generator=g) * 2
        v = torch.randn(kv_heads, num_blocks, block, dim, generator=g)
        for c, (start, rows) in enumerate(chunks):
            for pos in range(start + rows):
                b, slot = int(tables[c, pos // block]), pos % block
                if pos < start - window + 1:
                    k[:, b, slot] = v[:, b, slot] = float("nan")
                elif pos <= start + rows - window:  # some row's first position
                    v[:, b, slot] = 50.0
        k_cache, v_cache = k.to(dtype).transpose(2, 3).contiguous(), v.to(dtype)
        expected = reference(q, k_cache, v_cache, spans, tables, 0.125, window)
        shorter = reference(q, k_cache, v_cache, spans, tables, 0.125, window - 1)
        assert ((expected - shorter).abs().amax((1, 2)) > 0.05).sum() > num_rows // 2
        out = paged_prefill_attention(q, k_cache, v_cache, spans, tables, 0.125, window=window)
        assert_close(out, expected, dtype, f"{isa} {window=}")


def test_chunked_with_a_window_is_the_whole_prompt():
    """A prompt in chunks (each after the ones before, read back from the cache) gives the same
    bits as in one call, window and cap on."""
    q, k_cache, v_cache, _, tables = random_case((64, 9, 3), torch.float32, 16, 17)
    whole = torch.tensor([[0, 200, 0]])
    pieces = torch.tensor([[0, 37, 0], [37, 100, 37], [137, 63, 137]])
    options = dict(window=50, softcap=5.0)
    one = paged_prefill_attention(q, k_cache, v_cache, whole, tables[:1], 0.125, **options)
    parts = paged_prefill_attention(q, k_cache, v_cache, pieces, tables[:1].expand(3, -1)
                                    .contiguous(), 0.125, **options)  # fmt: skip
    assert torch.equal(one[:200], parts[:200])


def test_window_and_softcap_bad_values_raise_value_error():
    q, k_cache, v_cache, spans, tables = random_case((64, 6, 2), torch.float32, 16, 13)
    call = PrefillAttention(spans, tables, num_rows=q.shape[0], num_heads=6, k_cache=k_cache)
    for bad in (dict(window=-1), dict(softcap=-1.0), dict(softcap=float("nan")),
                dict(softcap=float("inf"))):  # fmt: skip
        with pytest.raises(ValueError):
            paged_prefill_attention(q, k_cache, v_cache, spans, tables, 0.125, **bad)
        with pytest.raises(ValueError):
            call.run(q, k_cache, v_cache, 0.125, torch.empty_like(q), **bad)
    # with a window, block ids before every row's window are never read: they need not be valid
    span, table = torch.tensor([[0, 10, 70]]), tables[:1].clone()
    table[0, :3] = -1  # positions 0..47; the first row (position 70) sees 61..70
    out = paged_prefill_attention(q, k_cache, v_cache, span, table, 0.125, window=10)
    expected = reference(q, k_cache, v_cache, span, tables[:1], 0.125, 10)
    assert_close(out, expected, torch.float32, "")
    with pytest.raises(ValueError, match="block id"):
        paged_prefill_attention(q, k_cache, v_cache, span, table, 0.125, window=30)
