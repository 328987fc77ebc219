"""The fused paged decode-attention kernel (pyserve._kernels via backends/cpu/attention_kernel.py).

Against a float64 reference that gathers each request's blocks and runs a plain softmax: random
block tables, contexts from 1 token to ~2000 (crossing block and partition boundaries), GQA
ratios 1/3/4, head_dim 64/128 (the vector paths' unrolled loops) and 40 (their masked/generic
loops), float32 / bfloat16 / float16 caches, every instruction set this CPU runs, 1 and 2
threads. Then: the result does not depend on the thread count (bit for bit), the CPU backend
gives the same answer through the kernel and through its torch path, and bad arguments raise
ValueError.
"""

from __future__ import annotations

import functools

import pytest
import torch
from worker_testlib import assert_attention_close as assert_close
from worker_testlib import paged_batch

from pyserve.worker import quant
from pyserve.worker.backends import attention_backend
from pyserve.worker.backends.cpu.attention_kernel import (
    DecodeAttention,
    PrefillAttention,
    paged_decode_attention,
)

torch.set_num_threads(2)
KERNELS = quant.kernels()
BEST_ISA = KERNELS.isa()
THREADS = KERNELS.num_threads()

BLOCK = 16
NUM_BLOCKS = 160
CONTEXTS = [1, 15, 16, 17, 255, 256, 257, 700, 1999]
# (head_dim, heads, kv_heads): GQA 3 (the default model's), 1 and 4, and a generic head_dim
SHAPES = [(64, 9, 3), (128, 4, 4), (64, 8, 2), (40, 3, 1)]


def random_cache(kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (kv_heads, NUM_BLOCKS, BLOCK, dim)
    # keys scaled up so that softmaxes are peaked, not near-uniform averages that hide mistakes
    k = (torch.randn(shape, generator=g) * 2).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    k = k.transpose(2, 3).contiguous()  # the cache keeps K dimension-major within a block
    return k, v


def random_tables(contexts: list[int], seed: int, dtype=torch.int32) -> torch.Tensor:
    """Each request's blocks: distinct random ids, the table padded with more random ids."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max(contexts) // BLOCK) + 1
    return torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in contexts]).to(
        dtype
    )


def reference(
    q, k_cache, v_cache, tables, contexts, scale, window=0, softcap=0.0, sinks=None, positions=None
) -> torch.Tensor:
    """float64: gather each request's first `context` tokens (with a window, the `window` up to
    its position: the last ones unless ``positions`` says where each query is), repeat kv heads,
    soft-cap the scores if asked, plain softmax (with ``sinks`` [H]: one more column per head,
    with no value)."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = []
    for d, n in enumerate(contexts):
        position = n - 1 if positions is None else int(positions[d])
        first = max(0, position - window + 1) if window else 0
        blocks = tables[d, : -(-n // BLOCK)].long()
        k = k_cache.index_select(1, blocks).transpose(2, 3).flatten(1, 2)[:, first:n].double()
        v = v_cache.index_select(1, blocks).flatten(1, 2)[:, first:n].double()
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        scores = (k @ q[d].double()[:, :, None])[..., 0] * scale  # [H, n - first]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            probs = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(-1)[:, :-1]
        out.append((probs[:, None, :] @ v)[:, 0])
    return torch.stack(out)


@functools.cache
def reference_case(dtype: torch.dtype, shape: tuple[int, int, int]):
    """Inputs and the float64 answer for one dtype and shape, shared by every ISA and thread
    count (the reference costs far more than the kernel)."""
    dim, heads, kv_heads = shape
    seed = dim + heads + kv_heads
    k_cache, v_cache = random_cache(kv_heads, dim, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(CONTEXTS), heads, dim, generator=g).to(dtype)
    # int32 and int64 indices both
    tables = random_tables(CONTEXTS, seed, torch.int32 if dim == 64 else torch.int64)
    lens = torch.tensor(CONTEXTS, dtype=torch.int64 if dim == 64 else torch.int32)
    expected = reference(q, k_cache, v_cache, tables, CONTEXTS, dim**-0.5)
    return q, k_cache, v_cache, tables, lens, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"dim{s[0]}-h{s[1]}-kv{s[2]}")
def test_matches_reference(isa, threads, dtype, shape):
    dim = shape[0]
    q, k_cache, v_cache, tables, lens, expected = reference_case(dtype, shape)
    # 0: the kernel's own split; 96: partitions that straddle blocks and tiles
    for partition in (0, 96):
        out = paged_decode_attention(
            q, k_cache, v_cache, tables, lens, dim**-0.5, partition_tokens=partition
        )
        assert out.shape == q.shape and out.dtype == dtype
        assert_close(out, expected, dtype, f"{isa} {dtype} partition={partition}")


def test_long_context_is_split_over_threads():
    """One request with a long context: the automatic choice cuts it into partitions."""
    partition = KERNELS.attention_partition_tokens(4096, 3, 2)
    assert 256 <= partition <= 4096 // 2
    assert KERNELS.attention_partition_tokens(4096, 3, 1) >= 4096  # one thread: no split
    assert KERNELS.attention_partition_tokens(100, 3, 2) == 256  # short: never split below 256


def test_mixed_dtypes_and_strided_rows():
    """float32 q over a bfloat16 cache; q rows strided (a view of q|k heads, as the model's)."""
    dim, heads, kv_heads = 64, 9, 3
    k_cache, v_cache = random_cache(kv_heads, dim, torch.bfloat16, 5)
    contexts = [3, 64, 513]
    qk = torch.randn(len(contexts), heads + kv_heads, dim)
    q = qk[:, :heads]
    tables = random_tables(contexts, 5)
    lens = torch.tensor(contexts)
    out = torch.full((len(contexts), heads, dim), float("nan"))
    result = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out)
    assert result is out
    assert_close(out, reference(q, k_cache, v_cache, tables, contexts, 0.125), torch.float32, "")


def test_same_bits_whatever_the_thread_count():
    dim, heads, kv_heads = 64, 9, 3
    k_cache, v_cache = random_cache(kv_heads, dim, torch.float32, 7)
    contexts = [1999, 5, 300, 1024, 77, 640]
    q = torch.randn(len(contexts), heads, dim, generator=torch.Generator().manual_seed(7))
    tables, lens = random_tables(contexts, 7), torch.tensor(contexts)
    results = []
    try:
        for n in (1, 2, 3):
            KERNELS.set_num_threads(n)
            results.append(paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                                  partition_tokens=128))  # fmt: skip
    finally:
        KERNELS.set_num_threads(THREADS)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_kernel_and_torch_paths_agree(dtype):
    """A mixed batch (prefills, a prefill after a prefix, decodes short and long) through the CPU
    kernels backend and through the torch reference (split softmax forced): same outputs, the
    same cache writes."""
    from pyserve.worker.backends.base import AttentionLayer
    from pyserve.worker.backends.cpu.backend import DecodeKernelBatch

    heads, kv_heads, dim, block = 9, 3, 64, 16
    shapes = [(300, 1), (0, 20), (40, 5), (0, 1), (1100, 1), (17, 1)]  # (start_pos, num_tokens)
    g = torch.Generator().manual_seed(3)
    _, batch = paged_batch(shapes, block, 200, g)
    total = batch.input_ids.numel()
    q, k, v = (
        torch.randn(total, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    layer = AttentionLayer(0, heads, kv_heads, dim, dim**-0.5)
    outs, caches = [], []
    for kind in ("cpu-kernels", "torch"):
        backend = attention_backend(
            kind, heads=heads, kv_heads=kv_heads, dim=dim, num_layers=1, num_blocks=200,
            block_size=block, dtype=dtype, max_chunk_tokens=64,
        )  # fmt: skip
        cache = backend.kv_cache
        init = torch.Generator().manual_seed(4)
        for t in cache.k + cache.v:
            t.copy_(torch.randn(t.shape, generator=init))
        meta = backend.prepare(batch)
        if kind == "cpu-kernels":
            assert isinstance(meta.decode, DecodeKernelBatch)
            # the prefill kernel where its AVX-512 loops run
            assert isinstance(meta.prefill, PrefillAttention) == (BEST_ISA == "avx512_vnni")
        outs.append(backend.attend_qkv(layer, q, k, v, meta))
        caches.append((cache.k[0].clone(), cache.v[0].clone()))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (outs[0].float() - outs[1].float()).abs().max() < tol
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_bad_arguments_raise_value_error():
    dim, heads, kv_heads = 64, 6, 2
    k_cache, v_cache = random_cache(kv_heads, dim, torch.float32, 9)
    contexts = [5, 40]
    q = torch.randn(2, heads, dim)
    tables, lens = random_tables(contexts, 9), torch.tensor(contexts)

    def call(**changes):
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, context_lens=lens)
        args.update(changes)
        return paged_decode_attention(scale=0.125, **args)

    call()  # the unchanged arguments are fine
    bad = {
        "q of ints": dict(q=q.int()),
        "q head_dim": dict(q=torch.randn(2, heads, 32)),
        "q heads not a multiple": dict(q=torch.randn(2, 5, dim)),
        "q count": dict(q=torch.randn(3, heads, dim)),
        "q heads strided": dict(q=torch.randn(2, dim, heads).transpose(1, 2)),
        "cache 3-d": dict(k_cache=k_cache[0], v_cache=v_cache[0]),
        "cache strided": dict(k_cache=k_cache.transpose(2, 3)),
        "cache dtype mismatch": dict(v_cache=v_cache.double()),
        "cache of ints": dict(k_cache=k_cache.int(), v_cache=v_cache.int()),
        "float table": dict(block_tables=tables.float()),
        "table rows": dict(block_tables=tables[:1]),
        "float lengths": dict(context_lens=lens.float()),
        "zero context": dict(context_lens=torch.tensor([0, 40])),
        "context past the table": dict(context_lens=torch.tensor([5, tables.shape[1] * BLOCK + 1])),
        "block id too large": dict(block_tables=torch.full_like(tables, NUM_BLOCKS)),
        "negative block id": dict(block_tables=torch.full_like(tables, -1)),
    }
    for what, changes in bad.items():
        with pytest.raises(ValueError):
            call(**changes)
            pytest.fail(what)
    with pytest.raises(ValueError):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, partition_tokens=-1)
    with pytest.raises(ValueError):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=torch.empty(2, 6, 32))
    call_once = DecodeAttention(tables, lens, num_heads=heads, k_cache=k_cache)
    with pytest.raises(ValueError):  # a layer whose cache has another geometry
        call_once.run(q, k_cache[:, :10].contiguous(), v_cache[:, :10].contiguous(), 0.125)


# ------------------------------------------------------------------ sliding window and soft-cap

# (window, softcap) against CONTEXTS (1 … 1999): windows shorter than every context but the
# first, as long as a block, mid-block, equal to one context (700), longer than all; the cap alone
# (strong and mild) and with a window
EXTRAS = [(1, 0.0), (16, 0.0), (37, 0.0), (700, 0.0), (4096, 0.0), (0, 2.0), (0, 30.0), (100, 2.0)]
EXTRA_SHAPES = [(64, 9, 3), (128, 4, 4), (40, 3, 1)]


@functools.cache
def extras_reference(dtype, shape, window, softcap):
    q, k_cache, v_cache, tables, _, _ = reference_case(dtype, shape)
    return reference(q, k_cache, v_cache, tables, CONTEXTS, shape[0] ** -0.5, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", EXTRA_SHAPES, ids=lambda s: f"dim{s[0]}-h{s[1]}-kv{s[2]}")
def test_window_and_softcap_match_reference(isa, dtype, shape):
    dim = shape[0]
    q, k_cache, v_cache, tables, lens, plain = reference_case(dtype, shape)
    for window, softcap in EXTRAS:
        expected = extras_reference(dtype, shape, window, softcap)
        if window < 700:  # the feature changes the answer well beyond the tolerance
            assert (expected - plain).abs().max() > 0.05
        # 0: the kernel's split (of the window's tokens); 32 and 96: partitions inside windows
        for partition in (0, 32, 96):
            out = paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5,
                                         partition_tokens=partition, window=window,
                                         softcap=softcap)  # fmt: skip
            what = f"{isa} {dtype} window={window} softcap={softcap} partition={partition}"
            assert_close(out, expected, dtype, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_query_before_its_context_end_windows_from_its_own_position(isa, dtype):
    """Rows of a run that attend to each other both ways (Gemma 3's images) read past their own
    position: their window starts from where each is (``positions``), not from the context's end;
    positions mid-block, at the end, and far before it, over partitions."""
    shape = (64, 9, 3)
    q, k_cache, v_cache, tables, lens, _ = reference_case(dtype, shape)
    back = [0, 3, 15, 1, 100, 0, 40, 255, 600]  # how far before its context's end each query is
    ends = [max(0, n - 1 - b) for n, b in zip(CONTEXTS, back, strict=True)]
    positions = torch.tensor(ends, dtype=lens.dtype)
    scale = shape[0] ** -0.5
    for window in (16, 37, 300):
        expected = reference(
            q, k_cache, v_cache, tables, CONTEXTS, scale, window, positions=positions
        )
        at_end = reference(q, k_cache, v_cache, tables, CONTEXTS, scale, window)
        assert (expected - at_end).abs().max() > 0.05
        for partition in (0, 32, 96):
            out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                         partition_tokens=partition, window=window,
                                         positions=positions)  # fmt: skip
            assert_close(out, expected, dtype, f"{isa} {dtype} {window=} {partition=} positions")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 37])
def test_sinks_match_reference(isa, dtype, window):
    """A sink logit per head (gpt-oss), strong and weak against the scores, alone and with a
    window, in one partition and split over several (merged with the sinks once)."""
    shape = (64, 9, 3)
    q, k_cache, v_cache, tables, lens, plain = reference_case(dtype, shape)
    sinks = torch.linspace(-4.0, 6.0, shape[1])
    scale = shape[0] ** -0.5
    expected = reference(q, k_cache, v_cache, tables, CONTEXTS, scale, window, sinks=sinks)
    assert (expected - plain).abs().max() > 0.05
    for partition in (0, 32, 96):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                     partition_tokens=partition, window=window,
                                     sinks=sinks)  # fmt: skip
        assert_close(out, expected, dtype, f"{isa} {dtype} {window=} {partition=} sinks")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_reads_nothing_before_it_and_counts_its_first_position(isa, threads, dtype):
    """Every position before a request's window holds NaN in K and V (any read of one would show),
    the window's first position a V of 50 (leaving it out would show); windows start mid-block
    and cross partitions. Requests own disjoint blocks, so the poison is theirs alone."""
    dim, heads, kv_heads, num_blocks = 64, 9, 3, 300
    contexts = [700, 1999, 33, 257, 90]
    g = torch.Generator().manual_seed(21)
    widths = [-(-n // BLOCK) for n in contexts]
    ids = torch.randperm(num_blocks, generator=g)[: sum(widths)].split(widths)
    tables = torch.stack([torch.cat((i, i.new_zeros(max(widths) - len(i)))) for i in ids])
    lens = torch.tensor(contexts)
    q = torch.randn(len(contexts), heads, dim, generator=g).to(dtype)
    for window in (100, 250, 33):
        k = torch.randn(kv_heads, num_blocks, BLOCK, dim, generator=g) * 2
        v = torch.randn(kv_heads, num_blocks, BLOCK, dim, generator=g)
        for d, n in enumerate(contexts):
            first = max(0, n - window)
            for pos in range(first + 1):
                block, slot = int(tables[d, pos // BLOCK]), pos % BLOCK
                if pos < first:
                    k[:, block, slot] = v[:, block, slot] = float("nan")
                else:
                    v[:, block, slot] = 50.0
        k_cache, v_cache = k.to(dtype).transpose(2, 3).contiguous(), v.to(dtype)
        expected = reference(q, k_cache, v_cache, tables, contexts, 0.125, window)
        shorter = reference(q, k_cache, v_cache, tables, contexts, 0.125, window - 1)
        cut = lens >= window  # the requests whose window leaves a position out
        assert ((expected - shorter).abs().amax((1, 2))[cut] > 0.05).all()
        for partition in (0, 48, 96):
            out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                         partition_tokens=partition, window=window)  # fmt: skip
            assert_close(out, expected, dtype, f"{isa} window={window} partition={partition}")


def test_window_and_softcap_same_bits_whatever_the_thread_count():
    dim, heads, kv_heads = 64, 9, 3
    k_cache, v_cache = random_cache(kv_heads, dim, torch.float32, 8)
    contexts = [1999, 5, 300, 1024, 77, 640]
    q = torch.randn(len(contexts), heads, dim, generator=torch.Generator().manual_seed(8))
    tables, lens = random_tables(contexts, 8), torch.tensor(contexts)
    results = []
    try:
        for n in (1, 2, 3):
            KERNELS.set_num_threads(n)
            results.append(paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                                  partition_tokens=128, window=500,
                                                  softcap=3.0))  # fmt: skip
    finally:
        KERNELS.set_num_threads(THREADS)
    assert all(torch.equal(results[0], r) for r in results[1:])


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got − exact| in units of the float32 spacing at the exactly rounded value."""
    rounded = exact.float()
    spacing = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"))) - rounded.abs()).double()
    return (got.double() - exact).abs() / spacing


def tanh_inputs() -> torch.Tensor:
    """float32 values over tanh's whole range: dense around 0 and the 0.625 switch between the
    loops' two formulas, log-spaced magnitudes from 1e-30 to 1e4, both signs, exact zeros."""
    g = torch.Generator().manual_seed(5)
    dense = torch.linspace(-12.0, 12.0, 400_001)
    switch = torch.linspace(0.6, 0.65, 100_001)
    magnitudes = torch.logspace(-30, 4, 300_001)
    spread = torch.randn(200_000, generator=g) * 3
    x = torch.cat((dense, switch, magnitudes, spread, torch.tensor([0.0, -0.0, 0.625])))
    return torch.cat((x, -x)).float()


def test_softcap_tanh_within_one_and_a_half_ulp(isa):
    """The loops' tanh (through the soft-cap with cap 1, which multiplies by 1) against float64
    torch.tanh: at most 1.5 ulp (the vector loops measured ≤ 1.46 over every float32 in
    [1e-30, 30]; the scalar ones round double's), zero at zero and ±1 far out."""
    x = tanh_inputs()
    y = x.clone()
    top = KERNELS.attention_softcap(y.data_ptr(), y.numel(), 1.0)
    exact = torch.tanh(x.double())
    err = ulps(y, exact)
    assert err.max() <= 1.5, f"{isa}: {err.max():.2f} ulp at x = {x[err.argmax()]:.9g}"
    assert top == y.max() == 1.0
    assert (y[x == 0] == 0).all() and (y[x.abs() > 10].abs() == 1).all()
    # cap · tanh(s · (1 / cap)): 1 / cap, the argument and the product rounded too (measured
    # ≤ 3.2 ulp)
    for cap in (30.0, 0.5, 7.3):
        y = x.clone()
        top = KERNELS.attention_softcap(y.data_ptr(), y.numel(), cap)
        err = ulps(y, cap * torch.tanh(x.double() / cap))
        assert err.max() <= 3.5, f"{isa} cap {cap}: {err.max():.2f} ulp"
        assert top == y.max()
    # short inputs take the loops' tails
    for n in (1, 5, 15, 17):
        y = x[:n].clone()
        assert KERNELS.attention_softcap(y.data_ptr(), n, 1.0) == y.max()
        assert ulps(y, torch.tanh(x[:n].double())).max() <= 1.5


def test_window_and_softcap_bad_values_raise_value_error():
    dim, heads, kv_heads = 64, 6, 2
    k_cache, v_cache = random_cache(kv_heads, dim, torch.float32, 9)
    q = torch.randn(2, heads, dim)
    tables, lens = random_tables([5, 40], 9), torch.tensor([5, 40])
    call = DecodeAttention(tables, lens, num_heads=heads, k_cache=k_cache)
    for bad in (dict(window=-1), dict(softcap=-1.0), dict(softcap=float("nan")),
                dict(softcap=float("inf"))):  # fmt: skip
        with pytest.raises(ValueError):
            paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, **bad)
        with pytest.raises(ValueError):
            call.run(q, k_cache, v_cache, 0.125, **bad)
    with pytest.raises(ValueError, match="window"):  # the C++ checks as well
        KERNELS.paged_decode_attention(
            q.data_ptr(), heads * dim, 0, 2, heads, k_cache.data_ptr(), v_cache.data_ptr(), 0,
            kv_heads, NUM_BLOCKS, BLOCK, dim, tables.data_ptr(), 4, tables.shape[1],
            lens.data_ptr(), 8, 0.125, q.data_ptr(), heads * dim, 0, window=-1,
        )  # fmt: skip
    # with a window, block ids before it are never read, so they need not be valid
    poisoned = tables.clone()
    poisoned[1, :2] = -1  # positions 0..31 of the 40-token request: before a window of 8
    out = paged_decode_attention(q, k_cache, v_cache, poisoned, lens, 0.125, window=8)
    assert_close(out, reference(q, k_cache, v_cache, tables, [5, 40], 0.125, 8), torch.float32, "")
    with pytest.raises(ValueError, match="block id"):
        paged_decode_attention(q, k_cache, v_cache, poisoned, lens, 0.125, window=9)
