"""The Triton backend's int8 K/V (``--kv-cache-dtype int8``) on a GPU, where the tests cannot
reach: Triton's interpreter multiplies bfloat16 wrongly, and knows neither the GPU's rounding
nor its fused multiply-adds.

- store: the rope + K/V store kernel's int8 values and scales against kv_cache.quantize_int8 of
  what a float cache in the activations' dtype stores (values and scales that differ, and by how
  many units), with ties and an all-zero head among them;
- attention: decode (split-K) and extend over an int8 cache (a float16 scale per 32 values)
  against a float64 softmax over it dequantized, at Llama 3's, Gemma 2's, gpt-oss's and a
  head_dim of 80's shapes, beside the error of the same kernels over a float cache of the
  dequantized values in the activations' dtype;
- timing: decode attention over int8 and over bfloat16 K/V at Llama 3 8B's heads (triton's
  do_bench), with the bytes each reads per second.

    python benchmarks/triton_kv_int8.py --out results.json
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/triton_kv_int8.py --cpu   # a rehearsal
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from functools import partial

import torch

from pyserve.worker.backends.triton import attention, fused
from pyserve.worker.dtypes import kv_bytes_per_token_head, kv_int8_groups
from pyserve.worker.kv_cache import dequantize_int8, quantize_int8

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK = 16
# name: heads, kv heads, head dim, soft-cap, window, sinks
SHAPES = {
    "llama3": (32, 8, 128, None, None, False),
    "gemma2": (16, 8, 256, 50.0, 300, False),
    "gpt-oss": (64, 8, 64, None, 128, True),
    "head80": (32, 32, 80, None, None, False),  # Phi-2's: two groups of 32 and one of 16
}


def store(device: str, dtypes: list[str], tokens: int) -> dict:
    heads, kv_heads, dim, slots_total = 32, 8, 128, 4 * tokens
    results = {}
    for name in dtypes:
        dtype = DTYPES[name]
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device)
        qkv *= torch.rand(tokens, 1, device=device) * 4
        v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        v[0, 0] = 0.0
        v[1, 1] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * (dim // 8))
        qkv = qkv.to(dtype)
        angles = torch.rand(tokens, dim // 2, device=device) * 6
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
        sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None]
        slots = torch.randperm(slots_total, device=device)[:tokens]
        shape = (slots_total, kv_heads, dim)
        floats = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)]
        ints = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(2)]
        scale_shape = (slots_total, kv_heads, kv_int8_groups(dim))
        scales = [torch.zeros(scale_shape, dtype=torch.float16, device=device) for _ in range(2)]
        heads_of = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
        q_float = fused.rope_kv_store(qkv, cos, sin, slots, *floats, **heads_of)
        q_int8 = fused.rope_kv_store(
            qkv, cos, sin, slots, *ints, k_scale=scales[0], v_scale=scales[1], **heads_of
        )
        row: dict = {"q_equal": bool(torch.equal(q_float, q_int8))}
        for tag, stored, values, scale in zip("kv", floats, ints, scales, strict=True):
            want, want_scale = quantize_int8(stored[slots])
            units = (values[slots].int() - want.int()).abs()
            row[f"{tag}_values_differing"] = int((units > 0).sum())
            row[f"{tag}_most_units"] = int(units.max())
            row[f"{tag}_scales_differing"] = int((scale[slots] != want_scale).sum())
        row["ties"] = ints[1][slots[1], 1, :8].tolist()  # round half to even: 127 0 2 2 0 -2 -2 4
        results[name] = row
    return results


def int8_cache(slots: int, kv_heads: int, dim: int, device: str):
    """Random K/V, each group of 32 values of a token's head of its own magnitude, quantized:
    (int8 k, v, float16 scales k, v [slots, kv_heads, groups], k and v dequantized)."""
    groups = kv_int8_groups(dim)

    def magnitude() -> torch.Tensor:
        per_group = torch.exp(torch.randn(slots, kv_heads, groups, device=device))
        return per_group.repeat_interleave(32, dim=-1)[..., :dim]

    k = torch.randn(slots, kv_heads, dim, device=device) * magnitude()
    v = torch.randn(slots, kv_heads, dim, device=device) * magnitude()
    (k8, k_scale), (v8, v_scale) = quantize_int8(k), quantize_int8(v)
    k_deq, v_deq = dequantize_int8(k8, k_scale), dequantize_int8(v8, v_scale)
    # the kernels read the cache's memory: quantize_int8's values can be a view of wider ones
    return k8.contiguous(), v8.contiguous(), k_scale, v_scale, k_deq, v_deq


def softmax_reference(q, keys, values, pos: int, scale: float, softcap, window, sinks):
    """q [heads, dim] at position ``pos`` over keys/values [context, kv_heads, dim], float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.einsum("hd,hnd->hn", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(keys.shape[0], device=q.device)
    seen = positions <= pos
    if window is not None:
        seen &= positions > pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double()[:, None]), 1)
        v = torch.cat((v, v.new_zeros(v.shape[0], 1, v.shape[2])), 1)
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), v)


def request_kv(tables: torch.Tensor, r: int, length: int, cache: torch.Tensor) -> torch.Tensor:
    """The first ``length`` positions of request ``r`` in a cache [slots, kv_heads, dim]."""
    p = torch.arange(length, device=cache.device)
    return cache[tables[r, p // BLOCK].long() * BLOCK + p % BLOCK]


def worst(out, queries, rows_and_positions, tables, k_deq, v_deq, scale, softcap, window, sinks):
    """The largest error of ``out``'s rows against softmax_reference, each row (out's row, its
    request, its position) over its request's dequantized keys and values."""
    err = 0.0
    for row, r, pos in rows_and_positions:
        keys, values = request_kv(tables, r, pos + 1, k_deq), request_kv(tables, r, pos + 1, v_deq)
        want = softmax_reference(queries[row], keys, values, pos, scale, softcap, window, sinks)
        err = max(err, (out[row].double() - want).abs().max().item())
    return err


def attention_errors(device: str, dtypes: list[str], small: bool) -> dict:
    results = {}
    contexts = [1, 17, 40, 50, 60] if small else [1, 17, 700, 1500, 2049]
    # (cached prefix, new tokens) per extend entry, over the last three requests' tables
    entries = [(0, 1), (5, 12), (20, 10)] if small else [(0, 1), (5, 12), (600, 100)]
    for name, (heads, kv_heads, dim, softcap, window, has_sinks) in SHAPES.items():
        if small:
            heads, kv_heads = heads // 4, 2
        blocks = [-(-c // BLOCK) for c in contexts]
        num_blocks = sum(blocks) + 7
        k8, v8, k_scale, v_scale, k_deq, v_deq = int8_cache(
            num_blocks * BLOCK, kv_heads, dim, device
        )
        order = torch.randperm(num_blocks, device=device).int().tolist()
        tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32, device=device)
        for r, n in enumerate(blocks):
            tables[r, :n] = torch.tensor(order[:n], dtype=torch.int32)
            del order[:n]
        sinks = torch.randn(heads, device=device) if has_sinks else None
        scale = dim**-0.5
        reference = (tables, k_deq, v_deq, scale, softcap, window, sinks)
        ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731

        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            common = dict(block_size=BLOCK, num_kv_heads=kv_heads, scale=scale, softcap=softcap)
            common |= dict(window=window, sinks=sinks)
            int8_args = dict(k_scale=k_scale, v_scale=v_scale)
            float_caches = (k_deq.to(dtype), v_deq.to(dtype))
            queries = torch.randn(len(contexts), heads, dim, device=device).to(dtype)
            rows = torch.arange(len(contexts), dtype=torch.int32, device=device)
            outputs = []
            for caches, extra in (((k8, v8), int8_args), (float_caches, {})):
                out = torch.zeros_like(queries)
                attention.paged_decode_attention(
                    queries, *caches, out, tables, ints(contexts), rows,
                    max_context=max(contexts), num_splits=4, **common, **extra,
                )  # fmt: skip
                outputs.append(out)
            decoded = [(r, r, c - 1) for r, c in enumerate(contexts)]
            results[f"{name}-{dtype_name}-decode"] = {
                "int8_error": worst(outputs[0], queries, decoded, *reference),
                "float_cache_error": worst(outputs[1], queries, decoded, *reference),
            }
            starts, total = [], 0
            for _, n in entries:
                starts.append(total)
                total += n
            queries = torch.randn(total, heads, dim, device=device).to(dtype)
            picked = tables[-len(entries) :]
            spans = (ints(starts), ints([n for _, n in entries]), ints([p for p, _ in entries]))
            max_q = max(n for _, n in entries)
            outputs = []
            for caches, extra in (((k8, v8), int8_args), (float_caches, {})):
                out = torch.zeros_like(queries)
                attention.paged_extend_attention(
                    queries, *caches, out, picked, *spans, max_q_len=max_q, **common, **extra
                )
                outputs.append(out)
            first = len(contexts) - len(entries)
            extended = [
                (start + j, first + i, prefix + j)
                for i, ((prefix, n), start) in enumerate(zip(entries, starts, strict=True))
                for j in range(n)
            ]
            results[f"{name}-{dtype_name}-extend"] = {
                "int8_error": worst(outputs[0], queries, extended, *reference),
                "float_cache_error": worst(outputs[1], queries, extended, *reference),
            }
    return results


def timing(device: str) -> dict:
    from triton.testing import do_bench

    heads, kv_heads, dim = SHAPES["llama3"][:3]
    results = {}
    for batch, context in ((64, 4096), (8, 16384)):
        num_blocks = batch * context // BLOCK
        k8, v8, k_scale, v_scale, k_deq, v_deq = int8_cache(
            num_blocks * BLOCK, kv_heads, dim, device
        )
        k16, v16 = k_deq.bfloat16(), v_deq.bfloat16()
        del k_deq, v_deq
        tables = torch.randperm(num_blocks, device=device).int().view(batch, -1)
        contexts = torch.full((batch,), context, dtype=torch.int32, device=device)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        q = torch.randn(batch, heads, dim, device=device).bfloat16()
        out = torch.zeros_like(q)
        common = dict(max_context=context, block_size=BLOCK, num_kv_heads=kv_heads)
        common |= dict(scale=dim**-0.5, softcap=None, window=None, num_splits=16)

        decode = partial(attention.paged_decode_attention, q, out=out, tables=tables)
        decode = partial(decode, context=contexts, rows=rows, **common)
        int8 = partial(decode, k_cache=k8, v_cache=v8, k_scale=k_scale, v_scale=v_scale)
        int8_ms = do_bench(int8, warmup=25, rep=200)
        bf16_ms = do_bench(partial(decode, k_cache=k16, v_cache=v16), warmup=25, rep=200)
        tokens = 2 * batch * context * kv_heads  # K and V of each head
        results[f"batch{batch}-context{context}"] = {
            "int8_ms": int8_ms,
            "bf16_ms": bf16_ms,
            "int8_gb_per_s": tokens * kv_bytes_per_token_head("int8", dim) / int8_ms / 1e6,
            "bf16_gb_per_s": tokens * kv_bytes_per_token_head("bfloat16", dim) / bf16_ms / 1e6,
        }
        del k8, v8, k16, v16
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the results as JSON")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="small shapes on the CPU under TRITON_INTERPRET=1, float32 and float16 (a rehearsal)",
    )
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    dtypes = ["fp32", "fp16"] if args.cpu else ["bf16", "fp16", "fp32"]
    torch.manual_seed(0)
    parts: dict[str, Callable[[], dict]] = {
        "store": lambda: store(device, dtypes, 9 if args.cpu else 257),
        "attention": lambda: attention_errors(device, dtypes, small=args.cpu),
    }
    if not args.cpu:
        parts["timing"] = lambda: timing(device)
    results: dict = {}
    for name, part in parts.items():
        started = time.time()
        try:
            results[name] = part()
        except Exception:  # the other parts still run
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name + "_seconds"] = round(time.time() - started, 1)
        print(name, json.dumps(results[name], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
