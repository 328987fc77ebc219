"""The forward pass of a speculative verify entry on the CPU: one request, n new tokens.

The default model as `pyserve run` serves it (its GGUF's 4-bit layers on the int4 kernels,
int16 activations, a float16 K/V pool), one request whose first --context tokens are cached;
each timed step computes n new tokens at the end of that context, every one of them sampled
(a verify of n - 1 drafts), as the worker runs them. For each n it reports the median step in
ms with the CPU backend's decode-row limit (continuing entries of at most that many tokens
attend as decode rows, longer ones through the prefill kernel) as it is and at --compare-limit,
round-robin so that a busy machine slows both alike, and the ratio to a 1-token step.

    .venv/bin/python benchmarks/verify_step.py                          # contexts 300, 600, 1200
    .venv/bin/python benchmarks/verify_step.py --contexts 600 --compare-limit 8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_kernels.py

import torch

from pyserve.model_files import default_model_path
from pyserve.worker.backends.cpu import backend as cpu_backend
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.model_runner import ModelRunner
from pyserve.worker.settings import WorkerSettings

BLOCK = 16


def step_ms(runner: ModelRunner, ids: torch.Tensor, table: list[int], context: int, n: int):
    batch = ForwardBatch(
        input_ids=ids[context : context + n],
        positions=torch.arange(context, context + n),
        start_pos=[context],
        num_tokens=[n],
        block_tables=[table],
        sample_index=torch.arange(n),
    )
    start = time.perf_counter()
    runner.forward(batch)
    return (time.perf_counter() - start) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 600, 1200])
    p.add_argument("--max-tokens", type=int, default=16, help="n from 1 to this")
    p.add_argument("--compare-limit", type=int, default=8, help="the other decode-row limit")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    limits = [cpu_backend.SHORT_ENTRY_DECODE_ROWS, args.compare_limit]
    blocks = -(-(max(args.contexts) + args.max_tokens) // BLOCK)
    runner = ModelRunner(
        WorkerSettings(
            model=str(default_model_path()),
            num_blocks=blocks,
            block_size=BLOCK,
            quantization="auto",
            kv_cache_dtype="float16",
        )
    )
    print(f"{platform.processor() or platform.machine()}, nproc {os.cpu_count()}; "
          f"quantization {runner.quantization}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    table = list(range(blocks))
    ids = torch.randint(100, 40000, (max(args.contexts) + args.max_tokens,))
    for context in args.contexts:
        prompt = ForwardBatch(
            input_ids=ids[:context],
            positions=torch.arange(context),
            start_pos=[0],
            num_tokens=[context],
            block_tables=[table],
            sample_index=torch.tensor([context - 1]),
        )
        runner.forward(prompt)
        times: dict[tuple[int, int], list[float]] = {}
        for _ in range(args.rounds):
            for n in range(1, args.max_tokens + 1):
                for limit in limits:
                    cpu_backend.SHORT_ENTRY_DECODE_ROWS = limit
                    times.setdefault((limit, n), []).append(step_ms(runner, ids, table, context, n))
        cpu_backend.SHORT_ENTRY_DECODE_ROWS = limits[0]
        print(f"\ncontext {context}: median ms (x a 1-token step)")
        print("| n | " + " | ".join(f"decode rows up to {limit}" for limit in limits) + " |")
        print("|---|" + "---|" * len(limits))
        for n in range(1, args.max_tokens + 1):
            cells = []
            for limit in limits:
                ms = statistics.median(times[(limit, n)])
                cells.append(f"{ms:.2f} ({ms / statistics.median(times[(limit, 1)]):.2f}x)")
            print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
