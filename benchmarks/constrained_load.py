"""The serving cost of grammar-constrained decoding, side by side on one pyserve server.

One ``pyserve run`` on the default model (started here on a free port, stopped at the end with
its whole process tree), driven through ``benchmarks/serving.py``'s client (streaming chat
requests, one connection each, no ``ignore_eos``):

- throughput: ``--num-prompts`` requests at concurrency 32, 256 random prompt tokens, 128 output
  tokens, unconstrained (A) against every request under one JSON schema through
  ``response_format`` (B), run A B A B ... (``--rounds``) on fresh prompts each time. For each
  run: output tok/s, mean output tokens per request, TTFT and ITL p50, and the CPU seconds the
  server's processes spent per 1k output tokens (steadier than tok/s when other jobs share the
  cores); then the medians of each kind and B / A (target: output tok/s B / A >= 0.90). Some
  unconstrained replies end at EOS: their ``max_tokens`` (``--unconstrained-len``) is a little
  higher, so that both kinds' mean lengths are about 128;
- TTFT at concurrency 1, before and after the loads: ``--ttft-requests`` requests of each kind
  (16 tokens), interleaved A B A B on fresh prompts, after one constrained request that
  compiles the schema (before the loads it runs to the document's end, which is checked against
  the schema); the medians and the median of the paired differences (target: <= 5 ms).

The schema asks for 10 to 20 items of four length-limited strings: its documents are several
times longer than 128 tokens, so no constrained request ends before ``max_tokens`` because its
document closed. Sampling at temperature 1: greedy unconstrained replies to random prompts end
early at EOS, and the two kinds would not generate the same number of tokens.

    .venv/bin/python benchmarks/constrained_load.py
    .venv/bin/python benchmarks/constrained_load.py --rounds 3 --ttft-requests 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serving  # noqa: E402 (after the path: benchmarks/ is not a package)
from compare import (  # noqa: E402
    RunningServer,
    _unwind_on_signals,
    machine_line,
    pyserve_spec,
    running,
    stop_all,
)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TEXT = {"type": "string", "maxLength": 24}
ITEM = {
    "type": "object",
    "properties": {
        "title": TEXT,
        "author": TEXT,
        "genre": TEXT,
        "summary": {"type": "string", "maxLength": 48},
    },
    "required": ["title", "author", "genre", "summary"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"books": {"type": "array", "items": ITEM, "minItems": 10, "maxItems": 20}},
    "required": ["books"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "books", "schema": SCHEMA}}
KINDS = {"A unconstrained": {}, "B json_schema": {"response_format": RESPONSE_FORMAT}}


def client_args(args: argparse.Namespace, base_url: str, extra: dict, output_len: int):
    """serving.py's arguments for one kind of request."""
    return serving.parse_args(
        [
            "--base-url",
            base_url,
            "--api",
            "chat",
            "--no-ignore-eos",
            "--output-len",
            str(output_len),
            "--extra-body",
            json.dumps({"temperature": args.temperature, **extra}),
        ]
    )


def check_document(text: str) -> str:
    """'' if ``text`` is a document of SCHEMA, else what is wrong with it."""
    try:
        books = json.loads(text)["books"]
    except (ValueError, KeyError, TypeError) as e:
        return f"not a document: {e}"
    if not 10 <= len(books) <= 20:
        return f"{len(books)} items"
    for book in books:
        if set(book) != set(ITEM["properties"]):
            return f"keys {sorted(book)}"
        for key, value in book.items():
            if not isinstance(value, str) or len(value) > ITEM["properties"][key]["maxLength"]:
                return f"{key}: {value!r}"
    return ""


def server_cpu_seconds(server: RunningServer) -> float:
    """User + system CPU time of the server and every process below it."""
    total = 0.0
    for pid in [server.proc.pid, *(pid for pid, _ in server.descendants())]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return total


async def throughput(args: argparse.Namespace, server: RunningServer, tok) -> list[dict]:
    for k, extra in enumerate(KINDS.values()):  # the first full batches of a process: not measured
        prompts = serving.random_dataset(tok, args.concurrency, 256, seed=50_000 + k)
        ns = client_args(args, server.base_url, extra, 16)
        await serving.run_load(ns, prompts, args.concurrency, None)
    runs = []
    for r in range(args.rounds):
        for k, (kind, extra) in enumerate(KINDS.items()):
            prompts = serving.random_dataset(tok, args.num_prompts, 256, seed=100 * r + k)
            max_tokens = args.output_len if extra else args.unconstrained_len
            ns = client_args(args, server.base_url, extra, max_tokens)
            cpu = server_cpu_seconds(server)
            results, wall = await serving.run_load(ns, prompts, args.concurrency, None)
            cpu = server_cpu_seconds(server) - cpu
            s = serving.summarize(results, wall, args.concurrency, max_tokens)
            s["cpu_s_per_1k_tokens"] = 1000 * cpu / max(s["output_tokens"], 1)
            s["server_cores"] = cpu / wall
            runs.append({"round": r + 1, "kind": kind, **s})
            print(
                f"[round {r + 1}] {kind}: {s['output_tok_per_s']:.1f} tok/s, "
                f"{s['mean_output_len']:.1f} tokens a request, {s['failed']} failed, "
                f"server {s['cpu_s_per_1k_tokens']:.2f} CPU s / 1k tokens on "
                f"{s['server_cores']:.2f} cores",
                flush=True,
            )
    return runs


async def ttft(
    args: argparse.Namespace, server: RunningServer, tok, seed: int, warm_up_len: int
) -> dict:
    """TTFT (ms) of each kind at concurrency 1, the requests interleaved, after one constrained
    request of up to ``warm_up_len`` tokens."""
    short = {kind: client_args(args, server.base_url, x, 16) for kind, x in KINDS.items()}
    fresh = iter(serving.random_dataset(tok, 2 * args.ttft_requests + 1, 256, seed=seed))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        whole = client_args(args, server.base_url, KINDS["B json_schema"], warm_up_len)
        warm = await serving.send_request(session, whole, next(fresh))
        problem = warm.error or (check_document(warm.text) if warm_up_len > 128 else "unchecked")
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.ttft_requests):
            for kind, ns in short.items():
                res = await serving.send_request(session, ns, next(fresh))
                if not res.ok:
                    raise RuntimeError(f"{kind}: {res.error}")
                times[kind].append(res.ttft * 1000)
    a, b = times.values()
    return {
        "warm_up_tokens": warm.output_tokens,
        "warm_up_document": problem or "valid",
        "ttft_ms": times,
        "median_ms": {kind: statistics.median(t) for kind, t in times.items()},
        "median_paired_difference_ms": statistics.median(y - x for x, y in zip(a, b, strict=True)),
    }


def report(runs: list[dict], ttfts: list[dict]) -> dict:
    print("\n| round | run | output tok/s | mean output tokens | TTFT p50 | ITL p50 ", end="")
    print("| server CPU s / 1k tokens | server cores | failed |\n" + "|---" * 9 + "|")
    for r in runs:
        print(
            f"| {r['round']} | {r['kind']} | {r['output_tok_per_s']:.1f} | "
            f"{r['mean_output_len']:.1f} | {r['ttft_p50_ms']:.0f} ms | {r['itl_p50_ms']:.1f} ms "
            f"| {r['cpu_s_per_1k_tokens']:.3f} | {r['server_cores']:.2f} | {r['failed']} |"
        )
    summary: dict = {}
    for key in ("output_tok_per_s", "cpu_s_per_1k_tokens"):
        a, b = (statistics.median(r[key] for r in runs if r["kind"] == k) for k in KINDS)
        pairs = zip(runs[::2], runs[1::2], strict=True)  # A and B of each round
        per_round = [y[key] / x[key] for x, y in pairs]
        summary[key] = {"median A": a, "median B": b, "B / A": b / a, "rounds B / A": per_round}
        print(
            f"\n{key}: median A {a:.3f}, B {b:.3f}; B / A {b / a:.3f} "
            f"(rounds: {', '.join(f'{x:.3f}' for x in per_round)})",
            end="",
        )
    # rounds in which other jobs left the server (nearly) every core, in both runs
    cores = 0.9 * (os.cpu_count() or 1)
    quiet = [
        y["output_tok_per_s"] / x["output_tok_per_s"]
        for x, y in zip(runs[::2], runs[1::2], strict=True)
        if min(x["server_cores"], y["server_cores"]) >= cores
    ]
    summary["quiet_rounds_tok_per_s_B / A"] = quiet
    if quiet:
        print(
            f"\nrounds with >= {cores:.1f} server cores in both runs: output tok/s B / A "
            f"median {statistics.median(quiet):.3f} ({', '.join(f'{x:.3f}' for x in quiet)})",
            end="",
        )
    ratio = summary["output_tok_per_s"]["B / A"]
    print(f"\noutput tok/s B / A >= 0.90: {'met' if ratio >= 0.90 else 'NOT met'}")
    print("\n| TTFT at c=1 | requests each | A median | B median | B - A | paired B - A | met |")
    print("|---|---|---|---|---|---|---|")
    for phase, t in zip(("before the loads", "after the loads"), ttfts, strict=True):
        (ma, mb), diff = t["median_ms"].values(), t["median_paired_difference_ms"]
        n = len(t["ttft_ms"]["A unconstrained"])
        print(
            f"| {phase} | {n} | {ma:.1f} ms | {mb:.1f} ms | {mb - ma:+.1f} ms | {diff:+.1f} ms "
            f"| {'yes' if mb - ma <= 5 else 'NO'} |"
        )
    paired = [y - x for t in ttfts for x, y in zip(*t["ttft_ms"].values(), strict=True)]
    summary["ttft_paired_difference_ms"] = statistics.median(paired)
    print(f"both phases: median paired B - A {statistics.median(paired):+.1f} ms of {len(paired)}")
    warm = ttfts[0]
    print(f"warm-up document ({warm['warm_up_tokens']} tokens): {warm['warm_up_document']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="A B pairs of the throughput load")
    p.add_argument("--num-prompts", type=int, default=32, help="requests in each run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of the load")
    p.add_argument(
        "--unconstrained-len",
        type=int,
        default=132,
        help="max_tokens of its unconstrained requests (some end at EOS: the means should match)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ttft-requests", type=int, default=40, help="of each kind, at c=1")
    p.add_argument("--pyserve-args", default="", help="extra flags for pyserve run")
    p.add_argument("--out", type=Path, default=HERE / "out" / "constrained")
    args = p.parse_args(argv)
    _unwind_on_signals()
    sys.stdout.reconfigure(line_buffering=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"constrained_load.py {' '.join(sys.argv[1:])}\n{started}; {machine_line()}")
    tok = serving._tokenizer(None)
    try:
        with running(pyserve_spec("pyserve", args.pyserve_args.split()), args.out) as server:
            first = asyncio.run(ttft(args, server, tok, 10_000, warm_up_len=2048))
            runs = asyncio.run(throughput(args, server, tok))
            second = asyncio.run(ttft(args, server, tok, 20_000, warm_up_len=16))
    finally:
        stop_all()  # a server an error left running
    summary = report(runs, [first, second])
    print(machine_line())
    result = {"started": started, "args": vars(args), "runs": runs, "ttft": [first, second]}
    (args.out / "summary.json").write_text(json.dumps({**result, **summary}, indent=1, default=str))
    failed = sum(r["failed"] for r in runs)
    return 1 if failed or first["warm_up_document"] != "valid" else 0


if __name__ == "__main__":
    sys.exit(main())
