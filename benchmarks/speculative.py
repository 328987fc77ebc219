"""Speculative decoding at one stream: pyserve with and without n-gram drafts, and llama.cpp's
server with its n-gram modes, on the same GGUF file and the same requests.

Two loads, greedy, one request at a time, streamed through /v1/chat/completions:

- ``grounded``: edit a given source file and return it whole (prompts of ~300-600 tokens cut from
  this repository's own Python files, a rename to make), where the output quotes its input;
- ``chat``: ordinary questions, where the output quotes nothing.

Per server and load: decode tok/s (output tokens after the first, over the time from the first
token to the last, summed over the requests), TTFT, and the acceptance of drafts (pyserve's
/metrics; llama-server's ``timings.draft_n`` / ``draft_n_accepted``). Ratios are against pyserve
without speculation in the same run. The two pyserve servers run side by side and take each
request in turn (which goes first alternates), so that a shared machine's drift falls on both
alike; the idle one only polls. Each llama-server runs alone afterwards. Figures are wall-clock
on shared cores, so compare ratios, not absolute times.

    .venv/bin/python benchmarks/speculative.py                       # the default model
    .venv/bin/python benchmarks/speculative.py \
        --model benchmarks/out/kquant-models/0.5b/model-Q4_K_M.gguf
    .venv/bin/python benchmarks/speculative.py --llama-spec-types ngram-simple,ngram-map-k
    .venv/bin/python benchmarks/speculative.py --no-llama --spec-args \
        "--speculative-algorithm standalone --speculative-draft-model-path DRAFT.gguf"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import (
    BENCH_DIR,
    ServerSpec,
    _unwind_on_signals,
    find_llama_server,
    machine_line,
    pyserve_spec,
    running,
    stop_all,
)

from pyserve.model_files import default_model_path

REPO = BENCH_DIR.parent
SPEC_ARGS = "--speculative-algorithm ngram"
CHAT_QUESTIONS = [
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "What are the pros and cons of working from home?",
    "Write a short poem about autumn leaves.",
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between weather and climate.",
    "Suggest a simple recipe for dinner with rice and vegetables.",
    "Why do cats purr?",
    "What is a good way to start learning to play the guitar?",
    "Describe how bees make honey.",
    "What makes a good team leader?",
]


@dataclass
class Run:
    server: str
    load: str
    requests: int = 0
    output_tokens: int = 0
    decode_tokens: int = 0  # output tokens after each request's first
    decode_seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    drafted: int | None = None
    accepted: int | None = None

    def add(self, ttft: float, decode_seconds: float, tokens: int) -> None:
        """One request: its TTFT, the seconds from its first token to its last, its tokens."""
        self.requests += 1
        self.output_tokens += tokens
        if tokens > 1:
            self.decode_tokens += tokens - 1
            self.decode_seconds += decode_seconds
        self.ttft.append(ttft)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def grounded_prompts(n: int, min_chars: int = 800, max_chars: int = 1500) -> list[str]:
    """Edit-this-file requests over chunks of pyserve's own sources (each a rename to make)."""
    prompts = []
    for path in sorted((REPO / "pyserve").rglob("*.py")):
        text = path.read_text()
        if len(text) < min_chars:
            continue
        lines, chunk = text.splitlines(keepends=True), ""
        for line in lines[: len(lines) // 2]:
            if len(chunk) + len(line) > max_chars:
                break
            chunk += line
        names = re.findall(r"\bdef ([a-z_][a-z0-9_]{3,})\(", chunk)
        if len(chunk) < min_chars or not names:
            continue
        old = names[0]
        prompts.append(
            f"Here is a Python file:\n\n```python\n{chunk}```\n\nRename the function `{old}` to "
            f"`{old}_v2` everywhere in this file. Reply with the whole updated file in one "
            "```python block and nothing else."
        )
        if len(prompts) == n:
            break
    return prompts


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, float, int, dict]:
    """(TTFT, seconds from the first token to the last, output tokens, llama.cpp timings)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = last = None
    tokens, timings = 0, {}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("timings"):
                timings = event["timings"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    if first is None or last is None:
        return 0.0, 0.0, tokens, timings
    return first - started, last - first, tokens, timings


async def drive(servers, specs: list[ServerSpec], load: str, prompts: list[str], args) -> list[Run]:
    """One run per server: each prompt goes to every server, one after the other, their order
    reversed from prompt to prompt (two side by side share the machine's drift alike)."""
    runs = [Run(spec.name, load) for spec in specs]
    pairs = list(zip(servers, specs, strict=True))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # a connection per request: llama-server may close one after a stream ends
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for server, spec in pairs:
            for prompt in prompts[: args.warmup]:
                await one_request(session, server.base_url, spec.model, prompt, 16)
        before = [await spec_counters(session, s.base_url, p.kind) for s, p in pairs]
        order = list(range(len(servers)))
        for prompt in prompts:
            for j in order:
                ttft, decode_s, tokens, timings = await one_request(
                    session, servers[j].base_url, specs[j].model, prompt, args.output_len
                )
                runs[j].add(ttft, decode_s, tokens)
                if specs[j].kind == "llama.cpp":  # its own count, per request
                    runs[j].drafted = (runs[j].drafted or 0) + timings.get("draft_n", 0)
                    runs[j].accepted = (runs[j].accepted or 0) + timings.get("draft_n_accepted", 0)
            order.reverse()
        after = [await spec_counters(session, s.base_url, p.kind) for s, p in pairs]
    for run, b, a in zip(runs, before, after, strict=True):
        if b is not None and a is not None:
            run.drafted, run.accepted = a[0] - b[0], a[1] - b[1]
    return runs


async def spec_counters(session, url: str, kind: str) -> tuple[int, int] | None:
    """pyserve's drafted and accepted tokens so far (/metrics)."""
    if kind != "pyserve":
        return None
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    values = {}
    for name in ("pyserve_spec_draft_tokens_total", "pyserve_spec_accepted_tokens_total"):
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        values[name] = int(float(match.group(1))) if match else 0
    return values["pyserve_spec_draft_tokens_total"], values["pyserve_spec_accepted_tokens_total"]


def llama_spec(binary: str, gguf: str, spec_type: str | None) -> ServerSpec:
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}"]
    argv += ["-np", "1", "-c", "8192", "-t", "2"]
    name = "llama.cpp"
    if spec_type:
        argv += ["--spec-type", spec_type]
        name += f" {spec_type}"
    return ServerSpec(name, "llama.cpp", argv, model=Path(gguf).name)


def print_table(runs: list[Run]) -> None:
    base = {r.load: r.decode_tok_s for r in runs if r.server == "pyserve"}
    print(
        f"\n{'server':<44} {'load':<9} {'reqs':>4} {'out tok':>7} {'decode tok/s':>12} "
        f"{'vs pyserve':>10} {'TTFT p50':>9} {'accepted':>9}"
    )
    for r in runs:
        ttft = sorted(r.ttft)[len(r.ttft) // 2] if r.ttft else 0.0
        ratio = r.decode_tok_s / base[r.load] if base.get(r.load) else float("nan")
        acc = f"{100 * r.acceptance:.0f}%" if r.acceptance is not None else "-"
        print(
            f"{r.server:<44} {r.load:<9} {r.requests:>4} {r.output_tokens:>7} "
            f"{r.decode_tok_s:>12.1f} {ratio:>9.2f}x {ttft * 1e3:>7.0f}ms {acc:>9}"
        )


async def bench(args) -> list[Run]:
    gguf = args.model or default_model_path()
    loads = {
        "grounded": grounded_prompts(args.requests),
        "chat": CHAT_QUESTIONS[: args.requests],
    }
    loads = {name: loads[name] for name in args.loads}
    specs = [
        pyserve_spec("pyserve", args.pyserve_args.split(), args.model),
        pyserve_spec(f"pyserve {args.spec_args}",
                     [*args.pyserve_args.split(), *args.spec_args.split()], args.model),
    ]  # fmt: skip
    binary = None if args.no_llama else find_llama_server(args.llama_server)
    if binary:
        specs.append(llama_spec(binary, str(gguf), None))
        specs += [llama_spec(binary, str(gguf), t) for t in args.llama_spec_types.split(",") if t]
    runs = []
    with running(specs[0], args.out_dir) as plain, running(specs[1], args.out_dir) as spec:
        for load, prompts in loads.items():
            pair = await drive((plain, spec), specs[:2], load, prompts * args.rounds, args)
            for run in pair:
                print(f"[{run.server}] {load}: {run.decode_tok_s:.1f} decode tok/s")
            runs += pair
    for spec in specs[2:]:
        with running(spec, args.out_dir) as server:
            for load, prompts in loads.items():
                (run,) = await drive([server], [spec], load, prompts, args)
                print(f"[{spec.name}] {load}: {run.decode_tok_s:.1f} decode tok/s")
                runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--loads", nargs="+", default=["grounded", "chat"], choices=["grounded", "chat"])
    p.add_argument("--requests", type=int, default=8, help="requests per load")
    p.add_argument("--rounds", type=int, default=1, help="times each pyserve load is repeated")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--pyserve-args", default="", help="flags for both pyserve runs")
    p.add_argument("--spec-args", default=SPEC_ARGS, help="the speculative pyserve run's own flags")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--llama-spec-types", default="ngram-simple,ngram-map-k,ngram-mod")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.out_dir = args.out_dir or BENCH_DIR / "out" / time.strftime("speculative-%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    _unwind_on_signals()
    sys.stdout.reconfigure(line_buffering=True)
    print(f"speculative.py {' '.join(sys.argv[1:])}\n{time.strftime('%Y-%m-%d %H:%M %Z')}; "
          f"{machine_line()}\nout: {args.out_dir}")  # fmt: skip
    try:
        runs = asyncio.run(bench(args))
    finally:
        stop_all()
    print_table(runs)
    (args.out_dir / "runs.json").write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
