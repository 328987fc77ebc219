"""The Triton kernels against plain torch, on small shapes, in Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``, set by conftest.py): norms, gated activations, RoPE + K/V store, paged
decode attention (GQA, split-K, windows, soft-capping) and extend attention over cached
prefixes. A GPU runs the same kernels compiled (benchmarks/gpu_check.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pyserve.worker.backends.triton import attention, fused
from pyserve.worker.kv_cache import dequantize_int8, quantize_int8
from pyserve.worker.rope import apply_rope

torch.manual_seed(0)


@pytest.mark.parametrize("width", [64, 96])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(width: int, with_residual: bool) -> None:
    x = torch.randn(5, width)
    weight = torch.randn(width)
    residual = torch.randn(5, width) if with_residual else None
    expected_residual = residual + x if with_residual else None
    reference = F.rms_norm(expected_residual if with_residual else x, (width,), weight, 1e-5)
    got = fused.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    if with_residual:
        torch.testing.assert_close(residual, expected_residual)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_matches_torch(activation: str) -> None:
    gate_up = torch.randn(3, 2 * 80) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(
        fused.gated_activation(gate_up, activation), act * up, rtol=1e-5, atol=1e-5
    )


def cos_sin(tokens: int, rotary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As rope.RotaryTable.cos_sin gives them: [T, 1, rotary], the sign folded into sin."""
    angles = torch.rand(tokens, rotary // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None, :]
    signed_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)[:, None, :]
    return cos, signed_sin


@pytest.mark.parametrize("rotary", [16, 8])  # all of each head, or part of it
def test_rope_kv_store_rotates_q_and_k_and_stores_k_and_v(rotary: int) -> None:
    heads, kv_heads, dim, tokens, slots_total = 4, 2, 16, 6, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    cos, signed_sin = cos_sin(tokens, rotary)
    slots = torch.tensor(random.Random(1).sample(range(slots_total), tokens))
    k_cache = torch.zeros(slots_total, kv_heads, dim)
    v_cache = torch.zeros(slots_total, kv_heads, dim)
    q = fused.rope_kv_store(
        qkv, cos, signed_sin, slots, k_cache, v_cache,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
    )  # fmt: skip
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim)
    rotated = apply_rope(qk, cos, signed_sin)
    torch.testing.assert_close(q, rotated[:, :heads], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_cache[slots], rotated[:, heads:], rtol=1e-6, atol=1e-6)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    torch.testing.assert_close(v_cache[slots], v)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def paged_cache(contexts: list[int], block_size: int, kv_heads: int, dim: int, seed: int):
    """Random K/V for requests of these lengths in shuffled blocks: (k, v caches [slots, kv_heads,
    dim], int32 tables [R, W], each request's keys and values [ctx, kv_heads, dim])."""
    rng = random.Random(seed)
    blocks = [-(-c // block_size) for c in contexts]
    ids = list(range(sum(blocks) + 3))
    rng.shuffle(ids)
    width = max(blocks)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    k_cache = torch.randn(len(ids) * block_size, kv_heads, dim)
    v_cache = torch.randn(len(ids) * block_size, kv_heads, dim)
    per_request = []
    for r, (context, count) in enumerate(zip(contexts, blocks, strict=True)):
        table = [ids.pop() for _ in range(count)]
        tables[r, :count] = torch.tensor(table, dtype=torch.int32)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(context)]
        )
        per_request.append((k_cache[slots], v_cache[slots]))
    return k_cache, v_cache, tables, per_request


def reference(q, keys, values, query_pos, scale, softcap, window, sinks=None):
    """q [heads, dim] at position query_pos over keys/values [ctx, kv_heads, dim], in float64;
    ``sinks`` [heads]: a column of each head's softmax with that logit and no value."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dim]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hnd->hn", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(keys.shape[0])
    seen = positions <= query_pos
    if window is not None:
        seen &= positions > query_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double()[:, None]), dim=1)
        v = torch.cat((v, v.new_zeros(v.shape[0], 1, v.shape[2])), dim=1)
    return torch.einsum("hn,hnd->hd", scores.softmax(dim=-1), v).float()


@pytest.mark.parametrize(
    "heads, kv_heads, block_size, num_splits, softcap, window",
    [
        (4, 4, 16, 1, None, None),
        (8, 2, 16, 3, None, None),  # GQA, split-K
        (6, 2, 4, 4, 30.0, None),  # a group of 3, soft-capping, small blocks
        (4, 1, 8, 2, None, 20),  # a sliding window: whole splits before it are empty
    ],
)
def test_paged_decode_matches_a_plain_softmax(
    heads, kv_heads, block_size, num_splits, softcap, window
):
    dim, contexts = 16, [1, 37, 90, 64]
    k_cache, v_cache, tables, per_request = paged_cache(contexts, block_size, kv_heads, dim, 3)
    rows = torch.tensor([3, 0, 5, 2], dtype=torch.int32)  # decode rows among other rows
    q = torch.randn(6, heads, dim)
    out = torch.full_like(q, 7.0)
    scale = 1 / math.sqrt(dim)
    attention.paged_decode_attention(
        q, k_cache, v_cache, out, tables, torch.tensor(contexts, dtype=torch.int32), rows,
        max_context=max(contexts), block_size=block_size, num_kv_heads=kv_heads, scale=scale,
        softcap=softcap, window=window, num_splits=num_splits, block_n=16,
    )  # fmt: skip
    for i, row in enumerate(rows.tolist()):
        keys, values = per_request[i]
        expected = reference(q[row], keys, values, contexts[i] - 1, scale, softcap, window)
        torch.testing.assert_close(out[row], expected, rtol=1e-4, atol=1e-5)
    assert (out[[1, 4]] == 7.0).all()  # rows that are not decode rows are left alone


@pytest.mark.parametrize("split_tokens", [16, 32, 160])  # 6 x 16 just covers 90; 160: one
def test_a_split_size_from_the_device_sets_what_each_split_covers(split_tokens: int):
    """As a decode graph runs it: the split count fixed by the model's whole context, the
    positions each split covers given in a device buffer for the step's longest context;
    splits past a request's context are empty."""
    heads, kv_heads, dim, contexts, num_splits = 4, 2, 16, [1, 37, 90], 6
    k_cache, v_cache, tables, per_request = paged_cache(contexts, 16, kv_heads, dim, 5)
    rows = torch.arange(3, dtype=torch.int32)
    q = torch.randn(3, heads, dim)
    out = torch.zeros_like(q)
    scale = 1 / math.sqrt(dim)
    attention.paged_decode_attention(
        q, k_cache, v_cache, out, tables, torch.tensor(contexts, dtype=torch.int32), rows,
        max_context=4096, block_size=16, num_kv_heads=kv_heads, scale=scale, softcap=None,
        window=None, num_splits=num_splits, block_n=16,
        split_tokens=torch.tensor([split_tokens], dtype=torch.int32),
    )  # fmt: skip
    for i, context in enumerate(contexts):
        keys, values = per_request[i]
        expected = reference(q[i], keys, values, context - 1, scale, None, None)
        torch.testing.assert_close(out[i], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "heads, kv_heads, softcap, window",
    [(4, 2, None, None), (4, 4, 50.0, None), (2, 1, None, 9)],
)
def test_extend_attends_over_the_cached_prefix_and_itself_causally(
    heads, kv_heads, softcap, window
):
    dim, block_size = 16, 8
    # (prefix, new tokens) per entry: a fresh prompt, a chunk after a cached prefix, a long chunk
    entries = [(0, 5), (11, 7), (3, 40)]
    contexts = [p + n for p, n in entries]
    k_cache, v_cache, tables, per_request = paged_cache(contexts, block_size, kv_heads, dim, 5)
    starts = [0, 5, 12]
    total_rows = 52
    q = torch.randn(total_rows, heads, dim)
    out = torch.zeros_like(q)
    scale = 1 / math.sqrt(dim)
    attention.paged_extend_attention(
        q, k_cache, v_cache, out, tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([n for _, n in entries], dtype=torch.int32),
        torch.tensor([p for p, _ in entries], dtype=torch.int32),
        max_q_len=40, block_size=block_size, num_kv_heads=kv_heads, scale=scale,
        softcap=softcap, window=window, block_m=16, block_n=16,
    )  # fmt: skip
    for (prefix, count), start, (keys, values) in zip(entries, starts, per_request, strict=True):
        for i in range(count):
            expected = reference(q[start + i], keys, values, prefix + i, scale, softcap, window)
            torch.testing.assert_close(out[start + i], expected, rtol=1e-4, atol=1e-5)


def test_the_flat_cache_stores_and_gathers_what_the_paged_one_does() -> None:
    from pyserve.worker.backends.triton.backend import FlatKVCache
    from pyserve.worker.kv_cache import PagedKVCache

    shape = dict(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=3, head_dim=8)
    paged = PagedKVCache(**shape, dtype=torch.float16)
    flat = FlatKVCache(**shape, dtype=torch.float16)
    slots = torch.tensor([0, 7, 9, 19, 4])
    k, v = torch.randn(5, 3, 8) * 1e5, torch.randn(5, 3, 8)  # k saturates in float16
    for cache in (paged, flat):
        cache.write(1, slots, k, v)
    blocks = torch.tensor([[1, 4], [0, 2]])
    for got, expected in zip(flat.gather(1, blocks), paged.gather(1, blocks), strict=True):
        torch.testing.assert_close(got, expected)
    assert flat.nbytes == paged.nbytes


# ---------------------------------------------------------------------------- int8 K/V


def rope_store(qkv, cos, signed_sin, slots, caches, heads, kv_heads, dim):
    """rope_kv_store into ``caches`` (k, v, and for an int8 cache k_scale, v_scale)."""
    k, v, *scales = caches
    return fused.rope_kv_store(
        qkv, cos, signed_sin, slots, k, v, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        **dict(zip(("k_scale", "v_scale"), scales, strict=False)),
    )  # fmt: skip


def int8_scales(slots: int, kv_heads: int, dim: int, fill: float = 0.0) -> torch.Tensor:
    """A FlatKVCache layer's int8 scales: float16 [slots, kv_heads, groups of 32]."""
    return torch.full((slots, kv_heads, -(-dim // 32)), fill, dtype=torch.float16)


@pytest.mark.parametrize("dim", [16, 64, 80])  # one group; two; two and a short one of 16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_kv_store_quantizes_each_group_as_quantize_int8(dtype, dim) -> None:
    """The int8 store's values and float16 scales (one per 32 values of a head) are
    kv_cache.quantize_int8's of the K/V that a cache in the activations' dtype stores, bit for
    bit: ties round to even, a group of zeros has scale 0, a scale past float16's range
    saturates, one below it underflows to 0 or a subnormal, and q is the float store's."""
    heads, kv_heads, tokens, total = 4, 2, 9, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim) * torch.rand(tokens, 1) * 4
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    last = (dim - 1) // 32 * 32  # the last group's first dim
    v[0, 0, last:] = 0.0  # scale 0
    # max |v| = 127 gives scale 1 and inverse 1: every half-integer is a tie
    v[1, 1] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * (dim // 8))
    v[2, 0] = torch.tensor([-127.0, 126.5, -125.5, 64.5] * (dim // 4))
    first = min(32, dim)  # the first group
    v[3, 1, :first] = 1e-9  # a scale under float16's subnormals: 0, values 0
    v[3, 0, :first] = torch.linspace(-3e-4, 3e-4, first)  # a float16 subnormal scale
    if dtype != torch.float16:  # past float16's range: the scale saturates at 65504
        v[4, 0, last] = 3e7
        k[5, 1] = 1e9  # a rotated key past it too
    if dtype == torch.float32:  # max / 127 halfway between two float16s: to the even one
        v[6, 0, 0] = 127 * (1 + 2**-11)  # 1 + 2^-11: down to 1
        v[6, 1, 0] = 127 * (1 + 3 * 2**-11)  # 1 + 3·2^-11: up to 1 + 2^-9
    qkv = qkv.to(dtype)
    cos, signed_sin = cos_sin(tokens, dim)
    slots = torch.tensor(random.Random(2).sample(range(total), tokens))
    float_caches = [torch.zeros(total, kv_heads, dim, dtype=dtype) for _ in range(2)]
    q_float = rope_store(qkv, cos, signed_sin, slots, float_caches, heads, kv_heads, dim)
    int8_caches = [torch.zeros(total, kv_heads, dim, dtype=torch.int8) for _ in range(2)]
    int8_caches += [int8_scales(total, kv_heads, dim, fill=-1.0) for _ in range(2)]
    q = rope_store(qkv, cos, signed_sin, slots, int8_caches, heads, kv_heads, dim)
    assert torch.equal(q, q_float)
    k_int8, v_int8, k_scale, v_scale = int8_caches
    for stored, values, scales in zip(float_caches, int8_caches[:2], int8_caches[2:], strict=True):
        want, want_scale = quantize_int8(stored[slots])
        assert torch.equal(values[slots], want)
        assert torch.equal(scales[slots], want_scale)
    groups = v_scale.shape[-1]
    assert v_scale[slots[0], 0, -1] == 0 and not v_int8[slots[0], 0, last:].any()
    assert v_scale[slots[3], 1, 0] == 0 and not v_int8[slots[3], 1, :first].any()
    assert 0 < v_scale[slots[3], 0, 0] < 2**-14  # a float16 subnormal
    if dtype != torch.float16:
        assert v_scale[slots[4], 0, -1] == 65504.0 and v_int8[slots[4], 0, last] == 127
        assert (k_scale[slots[5], 1] == 65504.0).all()
    if dtype == torch.float32:
        assert v_scale[slots[6], 0, 0] == 1.0 and v_scale[slots[6], 1, 0] == 1 + 2**-9
    if dtype != torch.float16:  # 127 and the half-integers are exact in each dtype but float16's
        ties = [127, 0, 2, 2, 0, -2, -2, 4] * min(4, dim // 8)
        assert v_int8[slots[1], 1, : len(ties)].tolist() == ties
        assert (v_scale[slots[1], 1] == 1.0).all() and groups == -(-dim // 32)
    untouched = torch.ones(total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_int8[untouched].any() and (k_scale[untouched] == -1).all()


def int8_paged_cache(contexts: list[int], block_size: int, kv_heads: int, dim: int, seed: int):
    """paged_cache's random K/V, each group of 32 values of a token's head of its own magnitude,
    quantized as kv_cache.quantize_int8 does it: (int8 k, v caches, their float16 scales
    [slots, kv_heads, groups], tables, each request's keys and values dequantized: what the
    kernels must attend over)."""
    k_cache, v_cache, tables, _ = paged_cache(contexts, block_size, kv_heads, dim, seed)
    gen = torch.Generator().manual_seed(seed)
    groups = -(-dim // 32)

    def magnitudes() -> torch.Tensor:
        per_group = torch.exp(torch.randn(k_cache.shape[0], kv_heads, groups, generator=gen))
        return per_group.repeat_interleave(32, dim=-1)[..., :dim]

    k_cache *= magnitudes()
    v_cache *= magnitudes()
    k_cache[tables[0, 0] * block_size] = 0.0  # a token whose K has scale 0
    k_cache[tables[1, 0] * block_size + 1, :, 32:] = 0.0  # groups of zeros beside live ones
    v_cache[tables[1, 0] * block_size + 2, :, :32] = 0.0
    (k_int8, k_scale), (v_int8, v_scale) = quantize_int8(k_cache), quantize_int8(v_cache)
    keys, values = dequantize_int8(k_int8, k_scale), dequantize_int8(v_int8, v_scale)
    # quantize_int8's values of a head_dim that is not a multiple of 32 are a view of wider ones
    k_int8, v_int8 = k_int8.contiguous(), v_int8.contiguous()
    per_request = []
    for r, context in enumerate(contexts):
        positions = torch.arange(context)
        slots = tables[r, positions // block_size].long() * block_size + positions % block_size
        per_request.append((keys[slots], values[slots]))
    return k_int8, v_int8, k_scale, v_scale, tables, per_request


# attention over int8 K/V against a float64 softmax over them dequantized: float32 as the float
# cache's tests; float16 rounds q, the weights, the output and, in a head of several groups, the
# values relative to their token's largest scale (as a float16 cache of them would) to its 11 bits
INT8_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (4e-3, 4e-3)}


# head dims: one group (16); 80, two groups and a short one of 16, in a tile of 128 dims (its
# last, padded group has no scale); 64, two groups filling the tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads, kv_heads, block_size, num_splits, softcap, window, dim",
    [
        (4, 4, 16, 1, None, None, 16),
        (8, 2, 16, 3, None, None, 80),  # GQA, split-K
        (6, 2, 4, 4, 30.0, None, 64),  # a group of 3, soft-capping, small blocks
        (4, 1, 8, 2, None, 20, 80),  # a sliding window
    ],
)
def test_paged_decode_reads_int8_kv_with_each_groups_scales(
    heads, kv_heads, block_size, num_splits, softcap, window, dim, dtype
):
    contexts = [1, 37, 90, 64]  # partial last blocks, and whole ones
    k_int8, v_int8, k_scale, v_scale, tables, per_request = int8_paged_cache(
        contexts, block_size, kv_heads, dim, 3
    )
    rows = torch.tensor([3, 0, 5, 2], dtype=torch.int32)
    q = torch.randn(6, heads, dim).to(dtype)
    out = torch.full_like(q, 7.0)
    scale = 1 / math.sqrt(dim)
    attention.paged_decode_attention(
        q, k_int8, v_int8, out, tables, torch.tensor(contexts, dtype=torch.int32), rows,
        max_context=max(contexts), block_size=block_size, num_kv_heads=kv_heads, scale=scale,
        softcap=softcap, window=window, num_splits=num_splits, block_n=16, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    rtol, atol = INT8_TOLERANCE[dtype]
    for i, row in enumerate(rows.tolist()):
        keys, values = per_request[i]
        expected = reference(q[row], keys, values, contexts[i] - 1, scale, softcap, window)
        torch.testing.assert_close(out[row].float(), expected, rtol=rtol, atol=atol)
    assert (out[[1, 4]] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads, kv_heads, block_size, softcap, window, dim",
    [
        (4, 2, 8, None, None, 80),
        (4, 4, 16, 50.0, None, 64),
        (6, 2, 4, None, 9, 80),
        (2, 1, 8, None, None, 16),
    ],
)
def test_extend_reads_int8_kv_with_each_groups_scales(
    heads, kv_heads, block_size, softcap, window, dim, dtype
):
    entries = [(0, 5), (11, 7), (3, 40)]  # a fresh prompt, a chunk after a prefix, a long one
    contexts = [p + n for p, n in entries]
    k_int8, v_int8, k_scale, v_scale, tables, per_request = int8_paged_cache(
        contexts, block_size, kv_heads, dim, 5
    )
    starts = [0, 5, 12]
    q = torch.randn(52, heads, dim).to(dtype)
    out = torch.zeros_like(q)
    scale = 1 / math.sqrt(dim)
    sinks = torch.randn(heads) if window is not None else None  # gpt-oss: sinks with windows
    attention.paged_extend_attention(
        q, k_int8, v_int8, out, tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([n for _, n in entries], dtype=torch.int32),
        torch.tensor([p for p, _ in entries], dtype=torch.int32),
        max_q_len=40, block_size=block_size, num_kv_heads=kv_heads, scale=scale,
        softcap=softcap, window=window, block_m=16, block_n=16, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    rtol, atol = INT8_TOLERANCE[dtype]
    for (prefix, count), start, (keys, values) in zip(entries, starts, per_request, strict=True):
        for i in range(count):
            row = q[start + i]
            expected = reference(row, keys, values, prefix + i, scale, softcap, window, sinks)
            torch.testing.assert_close(out[start + i].float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "scales",
    [
        {},
        # a float32 scale per (slot, head), or a float32 one per group: not the cache's
        {"k_scale": torch.ones(8, 1), "v_scale": torch.ones(8, 1)},
        {"k_scale": torch.ones(8, 1, 2), "v_scale": torch.ones(8, 1, 2)},
    ],
)
def test_the_kernels_refuse_int8_kv_without_its_float16_group_scales(scales) -> None:
    k = torch.zeros(8, 1, 40, dtype=torch.int8)
    q, ints = torch.zeros(1, 2, 40), torch.zeros(1, 1, dtype=torch.int32)
    wanted = r"an int8 cache needs k_scale: contiguous float16 \(8, 1, 2\)"
    with pytest.raises(ValueError, match=wanted):
        attention.paged_decode_attention(
            q, k, k.clone(), q.clone(), ints, ints[0] + 1, ints[0], max_context=1,
            block_size=8, num_kv_heads=1, scale=1.0, softcap=None, window=None, num_splits=1,
            **scales,
        )  # fmt: skip
    qkv = torch.zeros(1, 4 * 40)
    with pytest.raises(ValueError, match="an int8 cache needs k_scale"):
        fused.rope_kv_store(
            qkv, torch.ones(1, 1, 40), torch.zeros(1, 1, 40), torch.zeros(1, dtype=torch.int64),
            k, k.clone(), num_heads=2, num_kv_heads=1, head_dim=40, **scales,
        )  # fmt: skip


def test_the_int8_store_writes_the_bytes_the_flat_cache_writes() -> None:
    """The kernel's int8 store (RoPE as the identity) and FlatKVCache.write give the same bytes
    in every tensor of ``block_views`` (what the disk tier saves), and the flat cache gathers
    what the paged one does."""
    from pyserve.worker.backends.triton.backend import FlatKVCache
    from pyserve.worker.kv_cache import PagedKVCache

    heads, kv_heads, dim, layer = 4, 3, 40, 1  # a group of 32 and a short one of 8
    shape = dict(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=kv_heads, head_dim=dim)
    paged = PagedKVCache(**shape, dtype=torch.int8)
    flat = FlatKVCache(**shape, dtype=torch.int8)
    stored = FlatKVCache(**shape, dtype=torch.int8)
    slots = torch.tensor([0, 7, 9, 19, 4])
    k, v = torch.randn(5, kv_heads, dim) * 30, torch.randn(5, kv_heads, dim)
    k[2, 1] = 0.0
    v[3, 0, 32:] *= 1e4  # the short group of its own magnitude
    for cache in (paged, flat):
        cache.write(layer, slots, k, v)
    q = torch.randn(5, heads * dim)
    qkv = torch.cat((q, k.flatten(1), v.flatten(1)), dim=1)
    ones, zeros = torch.ones(5, 1, dim), torch.zeros(5, 1, dim)
    caches = (stored.k[layer], stored.v[layer], stored.k_scale[layer], stored.v_scale[layer])
    rope_store(qkv, ones, zeros, slots, caches, heads, kv_heads, dim)
    views = flat.block_views()
    assert len(views) == 8  # K, V, and both scales, of each layer
    assert flat.k_scale[layer].shape == (20, kv_heads, 2) and flat.v_scale[0].dtype == torch.float16
    for (got, dim_got), (want, dim_want) in zip(stored.block_views(), views, strict=True):
        assert dim_got == dim_want == 0 and torch.equal(got, want)
    # a block's scales: its tokens' of every kv head, as many bytes as the paged cache's
    assert views[-1][0][0].numel() == paged.block_views()[-1][0].select(1, 0).numel()
    blocks = torch.tensor([[1, 4], [0, 2]])
    for got, expected in zip(flat.gather(layer, blocks), paged.gather(layer, blocks), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert flat.nbytes == paged.nbytes
