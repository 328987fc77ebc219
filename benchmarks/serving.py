"""Load generator for any OpenAI-compatible server: pyserve, llama.cpp's, transformers serve.

Streams requests to /v1/completions (or /v1/chat/completions) with bounded concurrency or a
Poisson arrival rate and reports the metrics as `vllm bench serve` defines them:

- TTFT: send → first content event;  ITL: gaps between content events;
- TPOT: (E2E − TTFT) / (output tokens − 1);  output tok/s: total output tokens / wall time.

Datasets: seeded random prompts of a given token length, or a shared-prefix set (G groups × P
prompts sharing an S-token system prompt, each with its own Q-token question).

    python benchmarks/serving.py --base-url http://127.0.0.1:30000 --input-len 256 \
        --output-len 128 --num-prompts 48 --concurrency 1 8 32 --out out/pyserve.json
    python benchmarks/serving.py --plot out/pyserve.json out/llamacpp.json --png out/plot.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson


@dataclass
class Prompt:
    text: str
    input_len: int
    group: int = 0


@dataclass
class RequestResult:
    ok: bool
    input_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    content_events: int = 0  # streamed chunks with text (a chunk may carry several tokens)
    usage_reported: bool = False  # output_tokens came from the server's usage, not from events
    text: str = ""
    error: str = ""


# ----------------------------------------------------------------------------- datasets


def _tokenizer(name: str | None):
    from pyserve.model_files import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(name))


def _random_text(tok, rng: random.Random, length: int) -> str:
    """Text that re-tokenizes to about ``length`` tokens (ordinary word pieces, no specials)."""
    special = set(tok.all_special_ids)
    vocab = [i for i in range(min(len(tok), 32000)) if i not in special]
    ids = [rng.choice(vocab) for _ in range(length)]
    text = tok.decode(ids, skip_special_tokens=True)
    # Decoding and re-encoding does not round-trip exactly; trim or pad to the target.
    ids = tok.encode(text, add_special_tokens=False)[:length]
    while len(ids) < length:
        ids.append(rng.choice(vocab))
    return tok.decode(ids, skip_special_tokens=True)


def random_dataset(tok, n: int, input_len: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(_random_text(tok, rng, input_len), input_len) for _ in range(n)]


def shared_prefix_dataset(
    tok, groups: int, per_group: int, system_len: int, question_len: int, seed: int
) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        system = _random_text(tok, rng, system_len)
        for _ in range(per_group):
            question = _random_text(tok, rng, question_len)
            prompts.append(Prompt(system + " " + question, system_len + question_len, g))
    rng.shuffle(prompts)
    return prompts


# ----------------------------------------------------------------------------- client


def _body(args: argparse.Namespace, prompt: Prompt) -> dict:
    body: dict = {
        "model": args.model,
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(json.loads(args.extra_body))
    return body


async def send_request(
    session: aiohttp.ClientSession, args: argparse.Namespace, prompt: Prompt
) -> RequestResult:
    url = args.base_url.rstrip("/") + (
        "/v1/chat/completions" if args.api == "chat" else "/v1/completions"
    )
    res = RequestResult(ok=False, input_len=prompt.input_len)
    events = 0
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(url, json=_body(args, prompt)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    data = orjson.loads(payload)
                    if "error" in data:
                        res.error = str(data["error"])[:200]
                        return res
                    usage = data.get("usage")
                    if usage:
                        res.usage_reported = True
                        res.output_tokens = usage.get("completion_tokens", 0)
                        res.input_len = usage.get("prompt_tokens", res.input_len)
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = details.get("cached_tokens") or 0
                    for choice in data.get("choices") or []:
                        delta = (
                            choice.get("delta", {}).get("content")
                            if args.api == "chat"
                            else (choice.get("text"))
                        )
                        if not delta:
                            continue
                        res.text += delta
                        now = time.perf_counter()
                        if events == 0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        events += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.content_events = events
    if not res.usage_reported:  # count content events instead
        res.output_tokens = events
    res.ok = events > 0
    return res


async def run_load(
    args: argparse.Namespace, prompts: list[Prompt], concurrency: int, rate: float | None
) -> tuple[list[RequestResult], float]:
    # One connection per request (as vLLM's and SGLang's clients do): llama.cpp's server closes
    # reused connections.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(p: Prompt) -> RequestResult:
            async with sem:
                return await send_request(session, args, p)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one(p)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(
    results: list[RequestResult],
    wall: float,
    concurrency: int,
    requested_output_len: int | None = None,
    count_tokens=None,
) -> dict:
    """vLLM's metrics over one load, and the real output lengths: the server's own count
    (usage), the streamed chunks and, given ``count_tokens``, the streamed text re-tokenized."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    summary = {
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall,
        "request_per_s": len(ok) / wall,
        "output_tok_per_s": out_tokens / wall,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        **output_lengths(ok, requested_output_len, count_tokens),
    }
    for name, vals in (
        ("ttft", [r.ttft for r in ok]),
        ("itl", itl),
        ("tpot", tpot),
        ("e2e", [r.e2e for r in ok]),
    ):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = _pct(vals, q) * 1000
    return summary


def output_lengths(ok: list[RequestResult], requested: int | None, count_tokens=None) -> dict:
    lengths = [r.output_tokens for r in ok]
    out: dict = {
        "requested_output_len": requested,
        "mean_output_len": statistics.mean(lengths) if lengths else 0,
        "min_output_len": min(lengths, default=0),
        "max_output_len": max(lengths, default=0),
        # Outputs whose length differs from the request's max_tokens (an early EOS or a cut).
        "off_length_outputs": sum(n != requested for n in lengths) if requested else 0,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "mean_content_events": statistics.mean([r.content_events for r in ok]) if ok else 0,
    }
    if count_tokens is not None and ok:
        # Decoding and re-encoding need not round-trip exactly: a check, not the count.
        out["mean_retokenized_output_len"] = statistics.mean(count_tokens(r.text) for r in ok)
    return out


def print_table(rows: list[dict], label: str) -> None:
    print(f"\n== {label}")
    print(
        f"{'conc':>5} {'ok':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} "
        f"{'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} {'E2E p50':>9}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>5} {r['completed']:>4} {r['request_per_s']:>7.2f} "
            f"{r['output_tok_per_s']:>10.1f} {r['ttft_p50_ms']:>8.0f}ms {r['ttft_p99_ms']:>6.0f}ms "
            f"{r['itl_p50_ms']:>6.1f}ms {r['itl_p99_ms']:>6.1f}ms {r['tpot_p50_ms']:>7.1f}ms "
            f"{r['e2e_p50_ms']:>7.0f}ms"
        )
        if r["failed"]:
            print(f"      {r['failed']} failed: {r['errors']}")
        if r.get("off_length_outputs"):
            print(
                f"      {r['off_length_outputs']} outputs not of the requested "
                f"{r['requested_output_len']} tokens (min {r['min_output_len']}, "
                f"max {r['max_output_len']})"
            )


def plot(files: list[str], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("output_tok_per_s", "output tok/s"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("itl_p50_ms", "ITL p50 (ms)"),
        ("e2e_p99_ms", "E2E p99 (ms)"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4))
    for f in files:
        data = json.loads(Path(f).read_text())
        rows = sorted(data["runs"], key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        for ax, (key, title) in zip(axes, metrics, strict=True):
            ax.plot(xs, [r[key] for r in rows], marker="o", label=data.get("label", f))
            ax.set_title(title)
            ax.set_xlabel("concurrency")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])  # the concurrencies run, not powers of 2
    for ax in axes:
        ax.set_ylim(bottom=0)  # after all lines: it stops autoscaling
    axes[0].legend()
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name sent in bodies")
    p.add_argument("--tokenizer", default=None, help="model path for the tokenizer (default model)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--request-rate", type=float, default=None, help="Poisson rate (req/s)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--label", default=None)
    p.add_argument("--out", default=None, help="write JSON results here")
    p.add_argument("--plot", nargs="+", default=None, help="result JSON files to plot")
    p.add_argument("--png", default="benchmarks/out/serving.png")
    return p.parse_args(argv)


def build_prompts(args: argparse.Namespace) -> list[Prompt]:
    tok = _tokenizer(args.tokenizer)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(
            tok, args.groups, args.prompts_per_group, args.system_len, args.question_len, args.seed
        )
    return random_dataset(tok, args.num_prompts, args.input_len, args.seed)


async def benchmark(args: argparse.Namespace, prompts: list[Prompt] | None = None) -> dict:
    prompts = prompts or build_prompts(args)
    if args.warmup:
        await run_load(args, prompts[: args.warmup], args.warmup, None)
    runs = []
    for conc in args.concurrency:
        results, wall = await run_load(args, prompts, conc, args.request_rate)
        runs.append(summarize(results, wall, conc, args.output_len))
    label = args.label or args.base_url
    print_table(runs, label)
    return {
        "label": label,
        "args": vars(args),
        "runs": runs,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return 0
    result = asyncio.run(benchmark(args))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
