"""The serving benchmark's load, in process: the real planner and worker, no HTTP, no processes.

compare.py's concurrency-32 case (48 requests of 256 random prompt tokens, 128 output tokens
with ignore_eos, 32 running at a time) through ``OfflineEngine`` with the server's CPU defaults
(prefill budget and chunk, auto quantization, auto K/V dtype), so a change to the worker or the
kernels can be measured on the mixed load that decides the serving figures, in ~20 s a run
instead of the minutes a server start and the HTTP run take. It prints output tokens/s and where
the forward time went, by kind of step:

- prefill: steps with prompt tokens only; mixed: prompt chunks with decodes beside them;
- decode at each batch size (the first requests' 32, then the tail's 16).

    .venv/bin/python benchmarks/offline_load.py                    # 3 runs, the median
    .venv/bin/python benchmarks/offline_load.py --activation-bits 8

For an A/B of two builds on a noisy machine run it alternately from two installs (each run
prints its own figures) and compare medians: one run moves ±5-15% here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_worker.py: before torch loads

import torch

from pyserve.engine.config import EngineConfig
from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.offline import OfflineEngine


class StepLog:
    """Wraps the runner's forward: (prompt tokens, decode rows, seconds) of every step."""

    def __init__(self, engine: OfflineEngine) -> None:
        self.steps: list[tuple[int, int, float]] = []
        runner = engine.executor.runner
        forward = runner.forward

        def logged(batch: ForwardBatch) -> torch.Tensor:
            started = time.perf_counter()
            logits = forward(batch)
            prompt = sum(n for n in batch.num_tokens if n > 1)
            decodes = sum(1 for n in batch.num_tokens if n == 1)
            self.steps.append((prompt, decodes, time.perf_counter() - started))
            return logits

        runner.forward = logged

    def summary(self) -> dict[str, dict[str, float]]:
        kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for prompt, decodes, seconds in self.steps:
            kind = "mixed" if prompt and decodes else "prefill" if prompt else f"decode b={decodes}"
            totals = kinds[kind]
            totals[0] += 1
            totals[1] += prompt + decodes
            totals[2] += seconds
        total = sum(seconds for _, _, seconds in self.steps)
        other = [0, 0, 0.0]  # the kinds under 2% of the time: a shrinking batch's odd sizes
        for kind in [k for k, v in kinds.items() if v[2] < 0.02 * total]:
            other = [a + b for a, b in zip(other, kinds.pop(kind), strict=True)]
        if other[0]:
            kinds["other"] = other
        return {
            kind: {"steps": n, "tokens": tokens, "seconds": s, "tokens_per_s": tokens / s}
            for kind, (n, tokens, s) in sorted(kinds.items(), key=lambda kv: -kv[1][2])
        }


def load_engine(
    model: str | None,
    concurrency: int,
    tokens_each: int,
    *,
    quantization: str = "auto",
    activation_bits: int = 16,
    kv_cache_dtype: str = "auto",
) -> OfflineEngine:
    """An OfflineEngine with the server's CPU defaults (dtype, K/V dtype, prefill budget and
    chunk) for ``concurrency`` requests of up to ``tokens_each`` tokens at once."""
    config = EngineConfig(device="cpu", kv_cache_dtype=kv_cache_dtype)
    budget, chunk = config.resolved_prefill_budget()
    per_request = -(-(tokens_each + 1) // 16)
    engine = OfflineEngine(
        model,
        dtype=config.resolved_dtype(),
        quantization=quantization,
        activation_bits=activation_bits,
        kv_cache_dtype=config.resolved_kv_cache_dtype(),
        num_blocks=concurrency * per_request + 64,
        block_size=16,
        max_running_requests=concurrency,
        max_prefill_tokens=budget,
        chunked_prefill_size=chunk,
    )
    return engine


def load_prompts(engine: OfflineEngine, requests: int, prompt_len: int) -> list[list[int]]:
    """The load's prompts: random token ids of the model's vocabulary (seeded)."""
    rng = random.Random(0)
    vocab = engine.executor.runner.config.vocab_size
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(requests)]


def run_load(
    engine: OfflineEngine,
    prompts: list[list[int]],
    output_len: int,
    repeats: int,
    quiet: bool = False,
) -> list[dict]:
    """Runs the prompts ``repeats`` times (after a warm-up): per run, output tok/s, the wall
    time and where the forward time went (StepLog)."""
    runner = engine.executor.runner
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    runs = []
    for i in range(repeats):
        log = StepLog(engine)
        started = time.perf_counter()
        outputs = engine.generate(prompts, params)
        wall = time.perf_counter() - started
        del runner.forward  # the class's method again
        generated = sum(len(o.token_ids) for o in outputs)
        run = {"wall_s": wall, "output_tokens_per_s": generated / wall, "steps": log.summary()}
        runs.append(run)
        kinds = ", ".join(
            f"{kind} {v['seconds']:.1f} s ({v['tokens_per_s']:.0f} tok/s)"
            for kind, v in run["steps"].items()
        )
        if not quiet:
            print(f"run {i + 1}: {generated / wall:.1f} output tok/s, {wall:.1f} s; {kinds}")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32, help="requests running at once")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--activation-bits", type=int, default=16, choices=[8, 16])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_engine(
        args.model,
        args.concurrency,
        args.prompt_len + args.output_len,
        quantization=args.quantization,
        activation_bits=args.activation_bits,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    budget, chunk = EngineConfig(device="cpu").resolved_prefill_budget()
    runner = engine.executor.runner
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f}; quantization {runner.quantization}, activations "
        f"{args.activation_bits}-bit, K/V {runner.kv_cache_dtype_name}, prefill budget {budget} "
        f"(chunks of {chunk})"
    )
    prompts = load_prompts(engine, args.requests, args.prompt_len)
    runs = run_load(engine, prompts, args.output_len, args.repeats)
    median = statistics.median(r["output_tokens_per_s"] for r in runs)
    print(f"median: {median:.1f} output tok/s over {len(runs)} runs")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "runs": runs}))


if __name__ == "__main__":
    main()
