"""Soak test: steady load with random disconnects against a `pyserve run` it starts, watching
for leaks. Not part of CI; bounded to 10 minutes.

Client loops keep ``--concurrency`` streaming requests in flight (chat and completions, random
prompt and output lengths); a ``--disconnect`` fraction of them is cut off at a random point,
before the first byte or after a random number of events. Every ``--sample-every`` seconds it
records the resident memory of every process of the server (main, worker, detokenizer, read
from /proc, no psutil) and the KV accounting from /metrics. At the end it stops the load,
checks that the server comes back to rest (free + cached == total, no request state anywhere,
the server's own idle self-check clean) and reports each process's RSS growth between the end
of the warm-up and the end of the run (target < 5%).

    python benchmarks/soak.py                       # tiny random model, 3 minutes
    python benchmarks/soak.py --model default --minutes 8 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

# The `pyserve run` subprocess helper and the tiny model builder of the HTTP tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from http_testlib import Server, alive, kv_idle, metrics, server_processes, tiny_model

MAX_MINUTES = 10.0
ACCOUNTS = (
    "pyserve_engine_requests",
    "pyserve_core_requests",
    "pyserve_worker_requests",
    "pyserve_detokenizer_requests",
)
WORDS = ("the", "a", "river", "stone", "light", "over", "under", "north", "garden", "old")


# ----------------------------------------------------------------------------- processes


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ----------------------------------------------------------------------------- load


@dataclass
class LoadStats:
    completed: int = 0
    disconnected: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def random_request(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 200)))
    body = {"max_tokens": rng.randrange(1, max_tokens + 1), "stream": True, "temperature": 0}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    rng: random.Random,
    args: argparse.Namespace,
    stats: LoadStats,
) -> None:
    route, body = random_request(rng, args.max_tokens)
    if rng.random() < args.disconnect:
        if rng.random() < 0.3:  # before the first byte
            task = asyncio.create_task(session.post(url + route, json=body))
            await asyncio.sleep(rng.uniform(0, 0.2))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                (await task).close()
        else:
            async with session.post(url + route, json=body) as resp:
                for _ in range(rng.randrange(1, 20)):
                    if not await resp.content.readuntil(b"\n\n"):
                        break
                resp.close()
        stats.disconnected += 1
        return
    async with session.post(url + route, json=body) as resp:
        raw = await resp.read()
    events = raw.split(b"\n\n")
    errors = [e for e in events if e.startswith(b'data: {"error"')]
    if resp.status != 200 or events[-2:] != [b"data: [DONE]", b""] or errors:
        stats.failed += 1
        stats.errors.append(f"{resp.status}: {(errors or [raw[-300:]])[0]!r}")
        return
    stats.completed += 1


async def client_loop(
    session: aiohttp.ClientSession,
    url: str,
    seed: int,
    deadline: float,
    args: argparse.Namespace,
    stats: LoadStats,
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await one_request(session, url, rng, args, stats)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            stats.failed += 1
            stats.errors.append(repr(e))


# ----------------------------------------------------------------------------- sampling


async def sampler(
    url: str, pids: dict[str, int], every: float, started: float, samples: list[dict]
) -> None:
    while True:
        m = await asyncio.to_thread(metrics, url)
        sample = {"t": time.monotonic() - started}
        sample.update({f"rss_{role}": rss_bytes(pid) for role, pid in pids.items()})
        keys = ("pyserve_kv_blocks_total", "pyserve_kv_blocks_free", "pyserve_kv_blocks_cached")
        keys += ("pyserve_requests_running", "pyserve_requests_waiting", *ACCOUNTS)
        sample.update({k.removeprefix("pyserve_"): m[k] for k in keys})
        samples.append(sample)
        await asyncio.sleep(every)


async def wait_at_rest(url: str, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await asyncio.to_thread(metrics, url)
        if kv_idle(m) and all(m[k] == 0 for k in ACCOUNTS):
            return m
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come back to rest: {m}")
        await asyncio.sleep(0.2)


async def soak(url: str, pids: dict[str, int], args: argparse.Namespace) -> dict:
    stats = LoadStats()
    samples: list[dict] = []
    started = time.monotonic()
    deadline = started + args.minutes * 60
    sampling = asyncio.create_task(sampler(url, pids, args.sample_every, started, samples))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(
            *(
                client_loop(session, url, args.seed + i, deadline, args, stats)
                for i in range(args.concurrency)
            )
        )
    sampling.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampling
    wall = time.monotonic() - started
    at_rest = await wait_at_rest(url, 30)
    checks = at_rest["pyserve_idle_checks_total"]
    for _ in range(50):  # the idle self-check runs a second after the last activity
        at_rest = await asyncio.to_thread(metrics, url)
        if at_rest["pyserve_idle_checks_total"] > checks:
            break
        await asyncio.sleep(0.1)
    return {
        "wall_s": wall,
        "load": {k: v for k, v in vars(stats).items() if k != "errors"},
        "errors": stats.errors[:20],
        "samples": samples,
        "at_rest": at_rest,
    }


# ----------------------------------------------------------------------------- report


def growth(samples: list[dict], key: str, warmup_s: float) -> dict:
    """Median RSS over the first and the last 15% of the post-warm-up samples."""
    after = [s[key] for s in samples if s["t"] >= warmup_s]
    window = max(1, len(after) * 15 // 100)
    first, last = statistics.median(after[:window]), statistics.median(after[-window:])
    return {
        "after_warmup_mib": first / 2**20,
        "end_mib": last / 2**20,
        "peak_mib": max(after) / 2**20,
        "growth_pct": 100 * (last - first) / first,
    }


def report(result: dict, args: argparse.Namespace, pids: dict[str, int]) -> dict:
    samples = result["samples"]
    warmup_s = args.minutes * 60 * args.warmup
    rss = {role: growth(samples, f"rss_{role}", warmup_s) for role in pids}
    total = samples[-1]["kv_blocks_total"]
    used = [1 - (s["kv_blocks_free"] + s["kv_blocks_cached"]) / total for s in samples]
    rest = result["at_rest"]
    summary = {
        "model": args.model,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "disconnect_fraction": args.disconnect,
        **result["load"],
        "requests_per_s": (result["load"]["completed"] + result["load"]["disconnected"])
        / result["wall_s"],
        "generated_tokens_per_s": rest["pyserve_generation_tokens_total"] / result["wall_s"],
        "samples": len(samples),
        "rss": rss,
        "kv_max_in_use_pct": 100 * max(used),
        "at_rest": {
            "kv_free_plus_cached_eq_total": kv_idle(rest),
            **{k.removeprefix("pyserve_"): rest[k] for k in ACCOUNTS},
            "idle_checks": rest["pyserve_idle_checks_total"],
            "idle_check_failures": rest["pyserve_idle_check_failures_total"],
        },
        "max_growth_pct": max(r["growth_pct"] for r in rss.values()),
    }
    return summary


def print_summary(summary: dict) -> None:
    print(
        f"\n{summary['minutes']:g} min, {summary['concurrency']} clients, "
        f"{100 * summary['disconnect_fraction']:.0f}% disconnects, model {summary['model']}: "
        f"{summary['completed']} completed, {summary['disconnected']} cut off, "
        f"{summary['failed']} failed ({summary['requests_per_s']:.1f} requests/s, "
        f"{summary['generated_tokens_per_s']:.0f} generated tokens/s), "
        f"KV in use at most {summary['kv_max_in_use_pct']:.1f}%"
    )
    print("| process | RSS after warm-up | RSS at the end | peak | growth |")
    print("|---|---|---|---|---|")
    for role, r in summary["rss"].items():
        print(
            f"| {role} | {r['after_warmup_mib']:.1f} MiB | {r['end_mib']:.1f} MiB | "
            f"{r['peak_mib']:.1f} MiB | {r['growth_pct']:+.2f}% |"
        )
    print(f"at rest afterwards: {summary['at_rest']}")
    verdict = "met" if summary["max_growth_pct"] < 5 and not summary["failed"] else "NOT met"
    print(f"target (growth < 5%, no failed request): {verdict}")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny (random, 2 layers), default, or a path"
    )
    parser.add_argument("--minutes", type=float, default=3.0, help=f"at most {MAX_MINUTES:g}")
    parser.add_argument("--warmup", type=float, default=0.25, help="fraction of the run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--disconnect", type=float, default=0.3, help="fraction cut off")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-every", type=float, default=2.0, help="seconds")
    parser.add_argument("--kv-cache-tokens", type=int, default=16384)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pyserve-soak"))
    parser.add_argument("--out", help="write the samples and the summary as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= MAX_MINUTES:
        parser.error(f"--minutes must be in (0, {MAX_MINUTES:g}]")

    server_args = ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    server_args += ["--torch-threads", str(args.torch_threads), "--dtype", "float32"]
    if args.model == "tiny":
        server_args += ["--model", str(tiny_model(Path(args.workdir)))]
    elif args.model != "default":
        server_args += ["--model", args.model]
    server = Server(server_args)
    try:
        pids = server_processes(server.proc.pid)
        assert set(pids) == {"main", "worker", "detokenizer"}, pids
        result = asyncio.run(soak(server.url, pids, args))
    finally:
        code = server.stop()
    summary = report(result, args, pids)
    summary["server_exit_code"] = code
    summary["leftover_processes"] = [pid for pid in pids.values() if alive(pid)]
    print_summary(summary)
    print(f"server exit code {code}, leftover processes {summary['leftover_processes']}")
    if "idle accounting check failed" in server.log():
        print("the server's idle self-check reported a leak:")
        print("\n".join(line for line in server.lines if "idle accounting" in line))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
