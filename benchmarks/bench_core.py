"""The C++ scheduling core against the pure-Python reference model, side by side (issue 2, §5).

(a) prefix cache: for every request of a shared-prefix trace (64 system prompts of ~1k tokens,
    10k requests = system prompt + a short random question, block size 16), what the scheduler
    does on admission and completion: ``match_prefix``, allocate blocks for the rest,
    ``insert``, drop the caller's references (evicting LRU leaves when the pool runs short).
(b) planner: one decode step of 256 running requests, steady state: ``plan()`` then
    ``report()`` with one sampled token each, many iterations; µs per plan + report.
(c) the same under tenant fairness with 256 requests of another tenant waiting for a slot and a
    quantum never reached: what checking for a fairness preemption costs every step.

The Python loop around the calls is counted for both. Times are the CPU time of this process
(`time.process_time`), best of a few repeats, so that other work on a shared machine does not
inflate them; everything here runs on one thread. Token ids reach the core as packed int32
bytes, the form the main process holds them in (the core also takes lists: that figure is
printed too); the reference gets Python lists, its natural form. Block ids come back the same
way (int32 bytes from the core, lists from the reference), so one loop serves both. Targets:
core ≥ 20× the reference on both, and a 256-request plan + report under 50 µs.

    .venv/bin/python benchmarks/bench_core.py            # full run (about a minute)
    .venv/bin/python benchmarks/bench_core.py --quick    # a few seconds
    .venv/bin/python benchmarks/bench_core.py --write-results   # also update RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import time
from array import array
from pathlib import Path
from types import ModuleType, SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import core_reference  # noqa: E402

from pyserve import _core  # noqa: E402

VOCAB = 49152
BLOCK_SIZE = 16
TARGET_RATIO = 20.0
TARGET_PLAN_US = 50.0


def make_trace(num_prompts: int, prompt_len: int, num_requests: int, seed: int = 0):
    """Requests as token lists: a random system prompt, then a 8-64 token random question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(prompt_len)] for _ in range(num_prompts)]
    trace = []
    for _ in range(num_requests):
        question = [rng.randrange(VOCAB) for _ in range(rng.randint(8, 64))]
        trace.append(systems[rng.randrange(num_prompts)] + question)
    return trace


def run_prefix_cache(impl, trace: list, num_blocks: int, repeats: int) -> dict:
    """match_prefix + allocate + insert + release for every request of the trace, replayed on
    a fresh cache `repeats` times; the fastest replay counts (the machine is shared)."""
    best = float("inf")
    for _ in range(repeats):
        allocator = impl.BlockAllocator(num_blocks)
        cache = impl.RadixCache(BLOCK_SIZE, allocator)
        hit = 0
        start = time.process_time()
        for tokens in trace:
            matched, blocks, _ = cache.match_prefix(tokens)
            need = (token_count(tokens) - matched) // BLOCK_SIZE
            if need > allocator.num_free:
                cache.evict(need - allocator.num_free)
            fresh = allocator.allocate(need)
            cache.insert(tokens, blocks + fresh)  # int32 bytes from the core, lists from Python
            allocator.decref(fresh)  # the tree holds its own references now
            hit += matched
        best = min(best, time.process_time() - start)
    return dict(us_per_request=best / len(trace) * 1e6, hit_tokens=hit)


class _TunedRadixCache(core_reference.RadixCache):
    whole_edge_compare = True


# The reference with one CPython shortcut: a fully matching edge is one tuple comparison.
TUNED_PYTHON = SimpleNamespace(
    BlockAllocator=core_reference.BlockAllocator, RadixCache=_TunedRadixCache
)


def token_count(tokens) -> int:
    """Token count of a list or of packed int32 bytes."""
    return len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)


def run_decode_steps(
    impl: ModuleType, num_requests: int, iterations: int, repeats: int, fair: bool = False
) -> dict:
    """Steady-state decode: every step plans one token for each of num_requests requests.
    Times `repeats` windows of `iterations` steps; the fastest window counts. fair: tenant
    fairness on, the running requests tenant 1's, and as many of tenant 2 waiting (a quantum so
    large that none is ever preempted)."""
    prompt_len, max_new = 64, 8192
    per_request = (prompt_len + max_new) // BLOCK_SIZE + 1
    fairness = dict(tenant_fairness=True, fairness_quantum=2**62) if fair else {}
    planner = impl.Planner(
        per_request * num_requests,
        BLOCK_SIZE,
        max_running_requests=num_requests,
        max_prefill_tokens=num_requests * prompt_len,
        chunked_prefill_size=prompt_len,
        **fairness,
    )
    rng = random.Random(1)
    for rid in range(num_requests):
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        planner.add_request(rid, prompt, max_new, tenant=1 if fair else 0)
    tokens = array("i", [rng.randrange(VOCAB) for _ in range(num_requests)]).tobytes()
    # Warm up: the prefills, then enough decodes to reach the steady state.
    for _ in range(2 * BLOCK_SIZE):
        step = planner.plan()
        planner.report(step.step_id, step.rids, tokens[: 4 * step.num_requests])
    if planner.num_running != num_requests:
        raise RuntimeError(f"only {planner.num_running} of {num_requests} requests running")
    if fair:  # behind the running ones: the pool holds no more
        for rid in range(num_requests, 2 * num_requests):
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
            planner.add_request(rid, prompt, max_new, tenant=2)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(iterations):
            step = planner.plan()
            planner.report(step.step_id, step.rids, tokens)
        best = min(best, time.process_time() - start)
        if step.num_decode_tokens != num_requests:
            raise RuntimeError(f"a step decoded {step.num_decode_tokens} requests")
    return dict(us_per_step=best / iterations * 1e6)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{model}, nproc {nproc or os.cpu_count()}"


def write_results(section: str, path: Path) -> None:
    """Replaces the '## Core' section of RESULTS.md in place (appends it if there is none),
    keeping every other section as it is."""
    header = "# Benchmark results\n\nOne section per benchmark; each says how it was run.\n"
    text = path.read_text() if path.exists() else header
    out, skipping, written = [], False, False
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            skipping = line.strip() == "## Core"
            if skipping and not written:
                out.append(section + "\n")
                written = True
        if not skipping:
            out.append(line)
    body = "".join(out).rstrip("\n") + "\n"
    if not written:
        body += "\n" + section
    path.write_text(body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--write-results", action="store_true", help="update RESULTS.md")
    args = parser.parse_args()

    if args.quick:
        prompts, requests, core_iters, ref_iters, repeats = 8, 1000, 500, 10, 2
    else:
        prompts, requests, core_iters, ref_iters, repeats = 64, 10_000, 2000, 100, 3
    prompt_len, running = 1024, 256
    trace = make_trace(prompts, prompt_len, requests)
    packed = [array("i", tokens).tobytes() for tokens in trace]
    pool = 64 * 1024  # blocks: the whole trace fits, so timing is not about eviction

    core = run_prefix_cache(_core, packed, pool, repeats)
    core_lists = run_prefix_cache(_core, trace, pool, repeats)
    ref = run_prefix_cache(core_reference, trace, pool, repeats)
    tuned = run_prefix_cache(TUNED_PYTHON, trace, pool, repeats)
    if len({r["hit_tokens"] for r in (core, core_lists, ref, tuned)}) != 1:
        raise RuntimeError("the core and the reference disagree on prefix hits")
    step_core = run_decode_steps(_core, running, core_iters, repeats)
    step_ref = run_decode_steps(core_reference, running, ref_iters, repeats)
    fair_core = run_decode_steps(_core, running, core_iters, repeats, fair=True)
    fair_ref = run_decode_steps(core_reference, running, ref_iters, repeats, fair=True)

    cache_ratio = ref["us_per_request"] / core["us_per_request"]
    step_ratio = step_ref["us_per_step"] / step_core["us_per_step"]
    hit_rate = core["hit_tokens"] / sum(len(t) for t in trace)
    ok = (
        cache_ratio >= TARGET_RATIO
        and step_ratio >= TARGET_RATIO
        and step_core["us_per_step"] < TARGET_PLAN_US
    )

    def row(what: str, fast: float, slow: float, unit: str) -> str:
        return f"| {what} | {fast:.1f} {unit} | {slow:.1f} {unit} | {slow / fast:.1f}× |\n"

    trace_name = f"{requests} requests over {prompts} prompts of {prompt_len} tokens"
    table = "| benchmark | C++ core | Python | ratio |\n|---|---|---|---|\n"
    table += row(
        f"(a) match_prefix + insert, {trace_name} (hit rate {hit_rate:.1%}), reference",
        core["us_per_request"],
        ref["us_per_request"],
        "µs/request",
    )
    table += row(
        "(a) the same, core given token lists instead of packed bytes",
        core_lists["us_per_request"],
        ref["us_per_request"],
        "µs/request",
    )
    table += row(
        "(a) the same, against the reference with whole-edge tuple comparison",
        core["us_per_request"],
        tuned["us_per_request"],
        "µs/request",
    )
    table += row(
        f"(b) plan + report, decode step of {running} running requests",
        step_core["us_per_step"],
        step_ref["us_per_step"],
        "µs/step",
    )
    table += row(
        f"(c) the same with fairness on and {running} requests of another tenant waiting",
        fair_core["us_per_step"],
        fair_ref["us_per_step"],
        "µs/step",
    )
    verdict = (
        f"Targets (≥ {TARGET_RATIO:.0f}× the reference on (a) and (b), (b) < "
        f"{TARGET_PLAN_US:.0f} µs): " + ("met" if ok else "NOT met")
    )
    print(table + "\n" + verdict)

    if args.write_results:
        command = "benchmarks/bench_core.py" + (" --quick" if args.quick else "")
        date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
        section = (
            "## Core\n\n"
            f"Command: `.venv/bin/python {command}` (`make bench` runs the full one)  \n"
            f"Date: {date}  \n"
            f"Machine: {machine()}; block size {BLOCK_SIZE}; the reference is "
            "`tests/core_reference.py`.  \n"
            f"Times: CPU time of the benchmark process, best of {repeats} repeats (the machine "
            "is shared), including the Python loop around the calls for both sides.\n\n"
            + table
            + "\n"
            + verdict
            + "\n\n(c) minus (b): what tenant fairness costs a step when no preemption is due "
            "(the count per entry, the least-served waiting request among the first 256, the "
            "scan of the running ones for a tenant past the quantum).\n"
        )
        write_results(section, ROOT / "benchmarks" / "RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
