"""Decode attention on the CPU: the fused C++ kernel against the torch gather + matmul path.

One layer of the default model's attention (9 query heads, 3 kv heads, head_dim 64, 16-token
blocks) for B single-token requests whose contexts all have the same length, their blocks
scattered at random over the cache. Per case, round-robin so that a busy machine slows both
alike, it times

- ``torch``: the torch reference backend's decode (index_select gather of every request's blocks,
  batched matmuls, softmax / split softmax), its per-forward metadata built outside the timing;
- ``kernel``: the CPU kernels backend's call (K and V read in place, online softmax);
- ``write``: the KV write of the batch's new tokens (PagedKVCache.write), for scale.

and reports the median per call (µs) and the torch/kernel ratio. ``--clock cpu`` counts this
process's CPU time instead of wall time (less noisy on a shared machine, but with 2 threads it
adds both threads' time).

    .venv/bin/python benchmarks/bench_attention.py                     # all cases, wall clock
    .venv/bin/python benchmarks/bench_attention.py --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_kernels.py

import torch

from pyserve.worker import quant
from pyserve.worker.backends import attention_backend
from pyserve.worker.backends.base import AttentionLayer
from pyserve.worker.batch import ForwardBatch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_batch(batch: int, context: int, num_blocks: int, seed: int) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    per_request = -(-context // BLOCK)
    ids = torch.randperm(num_blocks, generator=g)[: batch * per_request].view(batch, -1)
    return ForwardBatch(
        input_ids=torch.zeros(batch, dtype=torch.int64),
        positions=torch.full((batch,), context - 1, dtype=torch.int64),
        start_pos=[context - 1] * batch,
        num_tokens=[1] * batch,
        block_tables=ids.tolist(),
        sample_index=torch.arange(batch),
    )


def measure(
    batch: int, context: int, dtype: torch.dtype, cache_dtype: torch.dtype, rounds: int, clock
) -> dict[str, float]:
    num_blocks = batch * -(-context // BLOCK) + 8
    kw = {"heads": HEADS, "kv_heads": KV_HEADS, "dim": HEAD_DIM, "num_layers": 1}
    kw.update(num_blocks=num_blocks, block_size=BLOCK, dtype=cache_dtype)
    torch_path = attention_backend("torch", **kw)
    kernel_path = attention_backend("cpu-kernels", **kw)
    cache = kernel_path.kv_cache
    for t in cache.k + cache.v:
        t.normal_()
    torch_path.kv_cache = torch_path.reference.kv_cache = cache
    fb = decode_batch(batch, context, num_blocks, seed=batch + context)
    torch_meta, kernel_meta = torch_path.prepare(fb), kernel_path.prepare(fb)
    q = torch.randn(batch, HEADS + KV_HEADS, HEAD_DIM).to(dtype)[:, :HEADS]  # strided, as live
    k = torch.randn(batch, KV_HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM**-0.5
    layer = AttentionLayer(0, HEADS, KV_HEADS, HEAD_DIM, scale)
    calls = {
        "torch": lambda: torch_path.reference.decode(layer, q, torch_meta.decode),
        "kernel": lambda: kernel_meta.decode.call.run(q, cache.k[0], cache.v[0], scale),
        "write": lambda: cache.write(0, kernel_meta.slots, k, k),
    }
    # enough calls per round for ~2 ms of work, so the clock's resolution does not matter
    repeats = max(1, 2000 // max(1, batch * context // 256))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            start = clock()
            for _ in range(repeats):
                fn()
            times[name].append((clock() - start) / repeats)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="comma list of model dtypes, each optionally /the KV cache's (float32/float16)",
    )
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=CLOCKS, default="wall")
    args = parser.parse_args()
    kernels = quant.kernels()
    clock = CLOCKS[args.clock]
    print(f"# {platform.processor() or platform.machine()}, isa {kernels.isa()}, "
          f"clock {args.clock}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| threads | dtype | batch | context | torch µs | kernel µs | torch/kernel | write µs |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        kernels.set_num_threads(threads)
        for dtype_name in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for context in (int(c) for c in args.contexts.split(",")):
                    q_name, _, cache_name = dtype_name.partition("/")
                    dtypes = DTYPES[q_name], DTYPES[cache_name or q_name]
                    t = measure(batch, context, *dtypes, args.rounds, clock)
                    ratio = t["torch"] / t["kernel"]
                    cells = [threads, dtype_name, batch, context, f"{t['torch']:.0f}",
                             f"{t['kernel']:.0f}", f"{ratio:.2f}", f"{t['write']:.0f}"]  # fmt: skip
                    print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
