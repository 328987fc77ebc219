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


def reference(q, keys, values, query_pos, scale, softcap, window):
    """q [heads, dim] at position query_pos over keys/values [ctx, kv_heads, dim], in float64."""
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
