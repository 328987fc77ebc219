"""int8 K/V (``--kv-cache-dtype int8``) against float16 and float32 K/V: logit drift and decode
speed, side by side.

- drift: prefill logits of random prompts with the model served as ``pyserve run`` serves it
  (``--quantization auto``, the cpu-kernels backend), its K/V stored in float16 and in int8,
  against the same weights with float32 K/V: top-1 agreement, |Δ logprob| of the float32-K/V
  top token, KL(float32 K/V ‖ stored). Prefill logits see the stored K/V: each chunk attends
  to its own K/V as the cache holds them.
- grouping: the same drift with K/V rounded on the torch backend as int8 with a scale per head
  (the cache's former format) and with a scale per 32 values (llama.cpp's q8_0, as the cache
  stores it but with float32 scales), both simulated (rounded, then held in a float32 cache).
- decode: tokens/s of greedy decode steps at each concurrency, every request at a
  ``--context``-token position. The contexts' K/V are random values written straight into the
  cache (the step's time does not depend on them; prefilling 32 × 4k tokens would take minutes
  here); each step reads all of them. The median step of ``--steps`` (the machine may be
  shared).
- kernel: the decode attention kernel alone over one layer (9 / 3 heads, head_dim 64 and 128,
  ``--kernel-queries`` requests at ``--context`` tokens, random values and scales), float16 and
  int8 calls alternating; the fastest of ``--kernel-calls`` each (the least disturbed on a
  shared machine).

    .venv/bin/python benchmarks/kv_int8.py                      # the default model
    .venv/bin/python benchmarks/kv_int8.py --model path/to/model --parts drift
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pyserve.testing.kv_fill import fill_random
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.model_runner import ModelRunner
from pyserve.worker.settings import WorkerSettings

BLOCK = 16
PARTS = ("drift", "grouping", "decode")  # and "kernel", on request


def runner(model: str | None, kv: str, tokens: int, backend: str = "auto") -> ModelRunner:
    return ModelRunner(
        WorkerSettings(
            model=model,
            num_blocks=-(-tokens // BLOCK) + 1,
            block_size=BLOCK,
            dtype="auto",
            quantization="auto",
            kv_cache_dtype=kv,
            backend=backend,
        )
    )


def fake_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., dim] rounded as symmetric int8 with a scale per ``group`` values, dequantized."""
    g = x.float().unflatten(-1, (-1, group))
    scale = g.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, g / scale, 0.0).round().clamp(-127, 127)
    return (q * scale).flatten(-2).to(x.dtype)


def grouping(model: str | None, prompts: int, length: int) -> list[str]:
    """int8 K/V with a scale per head (the cache's former format) against llama.cpp's q8_0
    grouping (a scale per 32 values, as the cache stores), simulated on the torch backend: a
    float32 cache written with each token's K/V rounded so, against the plain float32 cache."""
    from pyserve.worker.kv_cache import PagedKVCache

    gen = torch.Generator().manual_seed(0)
    write = PagedKVCache.write
    logits: dict[int, torch.Tensor] = {}
    batch: list[list[int]] = []
    dim = 0
    for group in (0, -1, 32):  # 0: float32; -1: one scale per head
        r = runner(model, "float32", length, backend="torch")
        dim = r.config.head_dim
        size = dim if group == -1 else group
        if group:
            PagedKVCache.write = lambda self, layer, slots, k, v, size=size: write(
                self, layer, slots, fake_int8(k, size), fake_int8(v, size)
            )
        if not batch:
            vocab = r.config.vocab_size
            batch = [torch.randint(0, vocab, (length,), generator=gen).tolist()
                     for _ in range(prompts)]  # fmt: skip
        try:
            logits[group] = torch.cat(
                [r.forward(ForwardBatch.whole_prompt(p, BLOCK)).float() for p in batch]
            )
        finally:
            PagedKVCache.write = write
        del r
    rows = []
    for group, label in ((-1, f"int8, a scale per head ({dim})"), (32, "int8, a scale per 32")):
        rows.append(drift_row(model, label, logits[0], logits[group]))
    return rows


def drift_row(model: str | None, label: str, ref: torch.Tensor, got: torch.Tensor) -> str:
    ref_lp, new_lp = ref.log_softmax(-1), got.log_softmax(-1)
    top = ref.argmax(-1, keepdim=True)
    agree = got.argmax(-1) == top[:, 0]
    drop = (new_lp.gather(1, top) - ref_lp.gather(1, top)).abs()[:, 0]
    kl = (ref_lp.exp() * (ref_lp - new_lp)).sum(-1)
    return (
        f"| {model or 'default (SmolLM2-135M Q4_1)'} | {label} | {len(ref)} | "
        f"{agree.float().mean() * 100:.1f}% | {drop.mean():.4f} / {drop.max():.3f} | "
        f"{kl.mean():.5f} / {kl.max():.4f} |"
    )


def drift(model: str | None, prompts: int, length: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    logits: dict[str, torch.Tensor] = {}
    batch: list[list[int]] = []
    for kv in ("float32", "float16", "int8"):
        r = runner(model, kv, length)
        if not batch:
            vocab = r.config.vocab_size
            batch = [torch.randint(0, vocab, (length,), generator=gen).tolist()
                     for _ in range(prompts)]  # fmt: skip
        logits[kv] = torch.cat(
            [r.forward(ForwardBatch.whole_prompt(p, BLOCK)).float() for p in batch]
        )
        name = f"{r.config.architecture} {r.packed_precisions}"
        del r
    print(f"drift: {name}", flush=True)
    return [drift_row(model, kv, logits["float32"], logits[kv]) for kv in ("float16", "int8")]


def decode_rate(model: str | None, kv: str, batch: int, context: int, steps: int) -> float:
    blocks_each = -(-(context + steps + 2) // BLOCK)
    r = runner(model, kv, batch * blocks_each * BLOCK)
    fill_random(r.kv_cache, torch.Generator().manual_seed(1))
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
    last = torch.zeros(batch, dtype=torch.int64)
    durations = []
    for step in range(steps + 1):  # the first: a warm-up
        pos = context + step
        fb = ForwardBatch(
            input_ids=last,
            positions=torch.full((batch,), pos),
            start_pos=[pos] * batch,
            num_tokens=[1] * batch,
            block_tables=tables,
            sample_index=torch.arange(batch),
        )
        start = time.perf_counter()
        last = r.forward(fb).argmax(-1)
        if step:
            durations.append(time.perf_counter() - start)
    kv_bytes = r.kv_cache.nbytes
    del r
    print(f"decode {kv} c={batch}: pool {kv_bytes / 2**30:.2f} GiB", flush=True)
    return batch / statistics.median(durations)


def kernel_times(queries: int, context: int, dim: int, calls: int) -> dict[str, float]:
    """ms of the fastest decode attention call over a float16 and an int8 cache."""
    from pyserve.worker.backends.cpu.attention_kernel import paged_decode_attention
    from pyserve.worker.kv_cache import PagedKVCache

    heads, kv_heads, per_request = 9, 3, -(-context // BLOCK)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(queries, heads, dim, generator=gen)
    tables = torch.randperm(queries * per_request, generator=gen).view(queries, per_request)
    lens = torch.full((queries,), context)
    caches = {}
    for kv in ("float16", "int8"):
        cache = PagedKVCache(num_layers=1, num_blocks=queries * per_request, block_size=BLOCK,
                             num_kv_heads=kv_heads, head_dim=dim,
                             dtype=getattr(torch, kv))  # fmt: skip
        fill_random(cache, gen)
        caches[kv] = cache
    times: dict[str, list[float]] = {kv: [] for kv in caches}
    for _ in range(calls):
        for kv, cache in caches.items():
            start = time.perf_counter()
            paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens, dim**-0.5,
                                   **cache.layer_scales(0))  # fmt: skip
            times[kv].append(time.perf_counter() - start)
    return {kv: min(t) * 1e3 for kv, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model path (default: the bundled SmolLM2)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--length", type=int, default=128, help="tokens of each drift prompt")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kernel-queries", type=int, default=32)
    p.add_argument("--kernel-calls", type=int, default=100)
    p.add_argument("--kernel-threads", type=int, default=0, help="0: the kernels' default")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if "drift" in parts:
        print(
            "| model | K/V | positions | top-1 agreement with float32 K/V | abs Δ logprob of its "
            "top token, mean / max | KL(float32 K/V ‖ stored), mean / max |\n"
            "|---|---|---|---|---|---|"
        )
        for row in drift(args.model, args.prompts, args.length):
            print(row, flush=True)
    if "grouping" in parts:
        for row in grouping(args.model, args.prompts, args.length):
            print(row, flush=True)
    if "decode" in parts:
        print("| concurrency | context | float16 K/V tok/s | int8 K/V tok/s | int8 / float16 |")
        print("|---|---|---|---|---|")
        for batch in map(int, args.batches.split(",")):
            rates = {
                kv: decode_rate(args.model, kv, batch, args.context, args.steps)
                for kv in ("float16", "int8")
            }
            print(
                f"| {batch} | {args.context} | {rates['float16']:.1f} | {rates['int8']:.1f} | "
                f"{rates['int8'] / rates['float16']:.2f} |",
                flush=True,
            )
    if "kernel" in parts:
        from pyserve.worker import quant

        kernels = quant.kernels()
        if args.kernel_threads:
            kernels.set_num_threads(args.kernel_threads)
        print(f"kernel: {kernels.isa()}, {kernels.num_threads()} threads")
        print("| requests | context | head_dim | float16 ms | int8 ms | int8 / float16 |")
        print("|---|---|---|---|---|---|")
        for dim in (64, 128):
            ms = kernel_times(args.kernel_queries, args.context, dim, args.kernel_calls)
            print(
                f"| {args.kernel_queries} | {args.context} | {dim} | {ms['float16']:.2f} | "
                f"{ms['int8']:.2f} | {ms['int8'] / ms['float16']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
