"""Embeddings per second at batch 32: pyserve beside ``llama-server --embedding`` on one file.

Each server in turn, on 127.0.0.1 (benchmarks/compare.py starts, waits for and stops them, and
finds or builds llama-server the same way), gets ``--rounds`` POSTs to /v1/embeddings of
``--batch`` fresh texts each (every text differs, so no prefix is shared), one request at a
time after one warm-up request. Both pool the same way (mean over the tokens, pyserve's default
for a generative model; llama-server ``--pooling mean``) and both normalize. Figures are
wall-clock on shared cores: run it alone on a quiet machine.

    .venv/bin/python benchmarks/embeddings.py                   # the default model, batch 32
    .venv/bin/python benchmarks/embeddings.py --pyserve-only --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare

from pyserve.model_files import default_model_path

# a sentence reads better than 27 quoted words
WORDS = "the a river mountain quick slow bright dark city garden engine window music paper stone"
WORDS += " light shadow ocean forest silver golden morning evening story number system language"


def texts(n: int, words: int, rng: random.Random) -> list[str]:
    return [
        " ".join(rng.choice(WORDS.split()) for _ in range(words)) + f" ({rng.random():.6f})"
        for _ in range(n)
    ]


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def measure(base_url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    url = base_url + "/v1/embeddings"
    post(url, {"model": model, "input": texts(args.batch, args.words, rng)})  # warm-up
    seconds, tokens, dims = [], 0, 0
    for _ in range(args.rounds):
        batch = texts(args.batch, args.words, rng)
        started = time.perf_counter()
        answer = post(url, {"model": model, "input": batch, "encoding_format": "float"})
        seconds.append(time.perf_counter() - started)
        assert len(answer["data"]) == args.batch, answer
        tokens += answer.get("usage", {}).get("prompt_tokens", 0)
        dims = len(answer["data"][0]["embedding"])
    total = sum(seconds)
    return {
        "embeddings_per_s": args.batch * args.rounds / total,
        "batch_seconds_p50": statistics.median(seconds),
        "prompt_tokens_per_s": tokens / total if tokens else None,
        "tokens_per_input": tokens / (args.batch * args.rounds) if tokens else None,
        "dimensions": dims,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="default: the bundled SmolLM2 Q4_1 file")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--words", type=int, default=40, help="words a text (~50 tokens)")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--pyserve-only", action="store_true")
    parser.add_argument("--pyserve-args", default="", help="extra pyserve flags, one string")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    gguf = args.gguf or default_model_path()
    compare._unwind_on_signals()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pyserve-bench-embed-") as out:
        out_dir = Path(out)
        spec = compare.pyserve_spec("pyserve", args.pyserve_args.split(), gguf)
        try:
            with compare.running(spec, out_dir) as server:
                runs = compare.describe_pyserve(server.base_url)
                results["pyserve"] = {**measure(server.base_url, spec.model, args, 1), **runs}
            binary = None if args.pyserve_only else compare.find_llama_server(args.llama_server)
            if binary is not None:
                argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}"]
                argv += ["--embedding", "--pooling", "mean", "-t", "2", "-c", "8192"]
                argv += ["-np", str(args.batch), "-b", "2048", "-ub", "2048"]
                llama = compare.ServerSpec("llama-server", "llama.cpp", argv, model=spec.model)
                with compare.running(llama, out_dir) as server:
                    results["llama-server"] = measure(server.base_url, spec.model, args, 1)
        finally:
            compare.stop_all()
    for name, r in results.items():
        print(
            f"{name:>13}: {r['embeddings_per_s']:7.1f} embeddings/s at batch {args.batch} "
            f"(batch p50 {r['batch_seconds_p50']:.3f} s, {r['dimensions']} dims, "
            f"{r['tokens_per_input'] or 0:.0f} tokens an input)"
        )
    if "llama-server" in results:
        ratio = results["pyserve"]["embeddings_per_s"] / results["llama-server"]["embeddings_per_s"]
        print(f"pyserve / llama-server: {ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
