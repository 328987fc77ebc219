"""Serving overhead: how many streamed tokens/s pyserve sustains when the model costs nothing.

Starts ``pyserve run`` on a tiny random-weight model (tests/tiny_models.py: 2 layers, hidden 64,
SmolLM2's vocabulary), drives N concurrent streams (default 256) of long outputs (``ignore_eos``)
from a lean client, and measures a steady-state window after a warm-up:

- streamed tokens/s: tokens handed to the requests' streams (``pyserve_streamed_tokens_total``),
  and the SSE content events the clients received per second (one a token at stream interval
  1, fewer where text is held back: half a UTF-8 character; the completed requests' usage
  chunks give the ratio);
- CPU seconds per 1k streamed tokens of main, worker and detokenizer (``/proc/<pid>/stat``);
- the worker's idle fraction, 1 − Δ``pyserve_worker_busy_seconds_total`` / Δwall, and its
  steps/s and tokens a step;
- the client's own CPU (it shares the machine's cores with the server).

The client is several processes of raw asyncio connections that count events without parsing
them (an aiohttp client parsing JSON per event eats a core by itself at these rates).

    python benchmarks/overhead.py                       # 256 streams, 512 tokens each
    python benchmarks/overhead.py --streams 64 --duration 10 --json out/overhead.json
    python benchmarks/overhead.py --streams 32 --route chat        # the same over a route's
    python benchmarks/overhead.py --streams 32 --route responses   # own events (no store)

``--route`` picks what the streams ask: ``completions`` (token-id prompts), ``chat`` or
``responses`` (the same prompt as text in one user message, so both render the same template).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from http_testlib import Server, metrics, server_processes  # noqa: E402
from tiny_models import SMOLLM2_VOCAB, build_tiny_smollm  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# SmolLM2's first 4096 ids: a 49152-token output projection would cost 1.6 GFLOP a step of
# 256 tokens, which is not overhead.
VOCAB = 4096


# ----------------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


# ----------------------------------------------------------------------------- client


@dataclass(frozen=True)
class Route:
    """How a route's stream is asked for and read: its path, the marker of its last event, how
    many of its events carry no content, and the usage field of its output tokens."""

    path: str
    end: bytes
    bare_events: int
    output_tokens: bytes


ROUTES = {
    # a finish chunk, the usage chunk, [DONE]
    "completions": Route("/v1/completions", b"data: [DONE]", 3, b'"completion_tokens":'),
    # the role chunk too
    "chat": Route("/v1/chat/completions", b"data: [DONE]", 4, b'"completion_tokens":'),
    # created, in_progress, item and part added, text done, part and item done, and the last
    # (response.incomplete: max_output_tokens ends every stream), the one with usage
    "responses": Route("/v1/responses", b'"usage":{', 8, b'"output_tokens":'),
    # message_start, the text block's start and stop, message_delta (the one with the final
    # usage; message_stop follows it)
    "messages": Route("/v1/messages", b"event: message_delta", 4, b'"output_tokens":'),
}


def request_bytes(
    host: str, port: int, prompt: list[int], output_len: int, route: str, store: bool
) -> bytes:
    text = " ".join(f"w{token}" for token in prompt)
    body: dict = {"max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True}
    if route == "completions":
        body["prompt"] = prompt
    elif route == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    elif route == "messages":  # no ignore_eos in Anthropic's body: a random model rarely ends
        body = {"model": "overhead", "max_tokens": output_len, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
    else:
        body = {"input": text, "max_output_tokens": output_len, "ignore_eos": True,
                "temperature": 0, "stream": True, "store": store}  # fmt: skip
    if route in ("completions", "chat"):
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    head = (
        f"POST {ROUTES[route].path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + payload


async def one_stream(
    host: str,
    port: int,
    payload: bytes,
    counter,
    slot: int,
    stop: asyncio.Event,
    read_interval: float,
    route: Route,
) -> tuple[int, int] | None:
    """One request read to its end (or until ``stop``); counts its content events into
    ``counter[slot]`` as they come. For a complete 200 stream, (content events, completion
    tokens from its usage chunk); else None."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(payload)
        first = await reader.read(65536)
        if not first.startswith(b"HTTP/1.1 200"):
            return None
        data, tail, seen = first[first.find(b"\r\n\r\n") + 4 :], b"", 0
        last = b""  # from the read that began the last event, once it has begun
        while not stop.is_set():
            joined = tail + data
            # Every event ends in a blank line; route.bare_events of them carry no content.
            events = joined.count(b"\n\n") - tail.count(b"\n\n")
            if last or route.end in joined:
                last = last + data if last else joined
            # the last event has ended (HTTP chunk framing may follow its blank line)
            done = bool(last) and b"\n\n" in last[last.find(route.end) :]
            events -= route.bare_events if done else 0
            counter[slot] += events
            seen += events
            if done:
                usage = last.rsplit(route.output_tokens, 1)[1]
                return seen, int(usage[: usage.find(b",")])
            tail = joined[-512:]  # holds the usage event when [DONE] comes in the next read
            if read_interval:  # let events gather: one read takes several
                await asyncio.sleep(read_interval)
            data = await reader.read(1 << 20)
            if not data:
                return None
        return None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def client_streams(
    host: str, port: int, streams: int, output_len: int, prompt_len: int, seed: int,
    counter, slot: int, stop_flag, results, read_interval: float, route: str, store: bool,
) -> None:  # fmt: skip
    stop = asyncio.Event()

    async def watch_stop() -> None:
        while not stop_flag.value:
            await asyncio.sleep(0.05)
        stop.set()

    async def stream_loop(index: int) -> None:
        rng = random.Random(seed * 100_003 + index)
        while not stop.is_set():
            prompt = [rng.randrange(100, VOCAB) for _ in range(prompt_len)]
            done = await one_stream(
                host, port, request_bytes(host, port, prompt, output_len, route, store), counter,
                slot, stop, read_interval, ROUTES[route],
            )  # fmt: skip
            if stop.is_set():
                return
            if done is None:
                results[4 * slot + 1] += 1
            else:
                results[4 * slot] += 1
                results[4 * slot + 2] += done[0]
                results[4 * slot + 3] += done[1]

    watcher = asyncio.create_task(watch_stop())
    await asyncio.gather(*(stream_loop(i) for i in range(streams)))
    watcher.cancel()


def client_process(*args) -> None:
    import uvloop

    uvloop.run(client_streams(*args))


# ----------------------------------------------------------------------------- measuring


def sample(url: str, pids: dict[str, int], counter) -> dict:
    m = metrics(url)
    return {
        "time": time.perf_counter(),
        "events": sum(counter),
        "cpu": {role: cpu_seconds(pid) for role, pid in pids.items()},
        "busy": m.get("pyserve_worker_busy_seconds_total", 0.0),
        "steps": m.get("pyserve_worker_steps_total", 0.0),
        "tokens": m.get("pyserve_streamed_tokens_total", 0.0),
    }


def summarize(a: dict, b: dict, args: argparse.Namespace, results) -> dict:
    wall = b["time"] - a["time"]
    events = b["events"] - a["events"]
    # a server without pyserve_streamed_tokens_total (an older build): the clients' events
    tokens = (b["tokens"] - a["tokens"]) or events
    per_1k = {role: 1000 * (b["cpu"][role] - a["cpu"][role]) / max(1, tokens) for role in a["cpu"]}
    cores = {role: (b["cpu"][role] - a["cpu"][role]) / wall for role in a["cpu"]}
    steps = b["steps"] - a["steps"]
    return {
        "streams": args.streams,
        "output_len": args.output_len,
        "prompt_len": args.prompt_len,
        "clients": args.clients,
        "read_interval": args.read_interval,
        "stream_interval": args.stream_interval,
        "route": args.route,
        "store": args.store,
        "window_s": wall,
        "streamed_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "events_per_s": events / wall,
        "cpu_s_per_1k_tokens": per_1k,
        "cpu_cores": cores,
        "worker_idle_fraction": 1.0 - (b["busy"] - a["busy"]) / wall,
        "worker_steps_per_s": steps / wall,
        "tokens_per_step": tokens / max(1, steps),
        "requests_completed": sum(results[0::4]),
        "requests_failed": sum(results[1::4]),
        # completed requests: content events a generated token (< 1: held-back text)
        "events_per_token": sum(results[2::4]) / max(1, sum(results[3::4])),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def print_summary(s: dict) -> None:
    print(
        f"{s['route']}: {s['streams']} streams × {s['output_len']} tokens, "
        f"{s['window_s']:.1f} s window: "
        f"{s['tokens_per_s']:,.0f} streamed tokens/s, {s['events_per_s']:,.0f} SSE events/s "
        f"({s['requests_completed']} requests done, {s['requests_failed']} failed, "
        f"{s['events_per_token']:.3f} events a token)"
    )
    print("CPU s per 1k tokens:  " + "  ".join(
        f"{role} {v:.3f} ({s['cpu_cores'][role]:.2f} cores)"
        for role, v in s["cpu_s_per_1k_tokens"].items()
    ))  # fmt: skip
    print(
        f"worker: idle {100 * s['worker_idle_fraction']:.1f}%, "
        f"{s['worker_steps_per_s']:.0f} steps/s, {s['tokens_per_step']:.0f} tokens a step"
    )
    print(
        f"server + client used {s['cores_used']:.2f} of {os.cpu_count()} cores; with all of them "
        f"at these CPU costs: {s['tokens_per_s_on_free_cores']:,.0f} tokens/s"
    )
    print("load average: " + " ".join(f"{x:.2f}" for x in s["load_average"]))


def start_profilers(args: argparse.Namespace, pids: dict[str, int]) -> list:
    """py-spy over the measured window, one flat profile a server process (they cost CPU
    themselves: take figures without them)."""
    if not args.py_spy:
        return []
    import subprocess

    out = Path(args.py_spy)
    out.mkdir(parents=True, exist_ok=True)
    py_spy = str(Path(sys.executable).parent / "py-spy")
    record = [py_spy, "record", "--native", "-r", "200", "-d", str(int(args.duration)), "-f", "raw"]
    return [
        subprocess.Popen(
            [*record, "-o", str(out / f"{role}.txt"), "-p", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in pids.items()
        if role in ("main", "worker", "detokenizer")
    ]


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace, model: Path, state_dir: Path) -> dict:
    server_args = ["--model", str(model), "--stream-interval", str(args.stream_interval)]
    server_args += ["--served-model-name", "overhead"]  # what the Messages route names
    server_args += ["--state-dir", str(state_dir)]  # stored responses (--store): not the user's
    server_args += ["--max-running-requests", str(max(256, args.streams)), *args.server_arg]
    server = Server(server_args)
    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Array("q", args.clients, lock=False)
    # per client: requests completed, failed, their content events, their completion tokens
    results = ctx.Array("q", 4 * args.clients, lock=False)
    stop = ctx.Value("b", 0, lock=False)
    clients = []
    try:
        pids = server_processes(server.proc.pid)
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        per_client = [len(range(i, args.streams, args.clients)) for i in range(args.clients)]
        for slot, streams in enumerate(per_client):
            proc = ctx.Process(
                target=client_process,
                args=(host, int(port), streams, args.output_len, args.prompt_len, slot,
                      counter, slot, stop, results, args.read_interval, args.route, args.store),
            )  # fmt: skip
            proc.start()
            clients.append(proc)
        time.sleep(args.warmup)
        for slot, proc in enumerate(clients):
            pids[f"client{slot}"] = proc.pid
        profilers = start_profilers(args, pids)
        first = sample(server.url, pids, counter)
        time.sleep(args.duration)
        last = sample(server.url, pids, counter)
        for profiler in profilers:
            profiler.wait()
        summary = summarize(first, last, args, results)
        client_roles = [r for r in pids if r.startswith("client")]
        summary["cpu_s_per_1k_tokens"]["client"] = sum(
            summary["cpu_s_per_1k_tokens"].pop(r) for r in client_roles
        )
        summary["cpu_cores"]["client"] = sum(summary["cpu_cores"].pop(r) for r in client_roles)
        # on a shared machine: the rate if these processes had every core to themselves
        total = sum(summary["cpu_s_per_1k_tokens"].values())
        summary["cores_used"] = sum(summary["cpu_cores"].values())
        summary["tokens_per_s_on_free_cores"] = (os.cpu_count() or 1) * 1000 / max(total, 1e-9)
        return summary
    finally:
        stop.value = 1
        for proc in clients:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams")
    parser.add_argument("--output-len", type=int, default=512, help="tokens a request")
    parser.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument(
        "--read-interval",
        type=float,
        default=0.0,
        help="seconds a client stream waits between reads (0: read as events come)",
    )
    parser.add_argument("--warmup", type=float, default=6.0, help="seconds before measuring")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds measured")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument(
        "--route", default="completions", choices=list(ROUTES), help="what the streams ask"
    )
    parser.add_argument(
        "--store", action="store_true", help="responses: store each (OpenAI's default)"
    )
    parser.add_argument("--model", help="a model directory; default: build the tiny model")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `pyserve run` argument"
    )
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--py-spy", metavar="DIR", help="profile the server's processes")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pyserve-overhead-") as tmp:
        model = Path(args.model) if args.model else None
        if model is None:
            # A text prompt and its chat template need the whole vocabulary.
            vocab = VOCAB if args.route == "completions" else SMOLLM2_VOCAB
            model = build_tiny_smollm(
                Path(tmp) / "tiny", seed=0, max_position_embeddings=4096, vocab_size=vocab
            )
        summary = run(args, model, Path(tmp) / "state")
    print_summary(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
