"""TTFT of a long prompt served from the prefix cache's disk tier after a restart, against the
same prompt computed cold and found in RAM, side by side on one `pyserve run` configuration.

For each of ``--prompts`` prompts of ``--prompt-tokens`` random token ids (distinct first tokens,
so they share nothing):

1. server A, on a fresh ``--state-dir``: the prompt cold (nothing cached), then again (a RAM
   hit: every whole block but the last is cached); A then stops cleanly, which saves its cached
   blocks to the disk tier;
2. server B, a new process on the same state directory: the prompt again, its blocks loaded
   from disk (the first request after the restart).

TTFT is the wall time of a /generate request for one token (queue, prefill or load, one
sample), measured by the client. The machine may be shared: the ratios (cold / disk,
cold / RAM) are the figures; each row is one prompt.

    .venv/bin/python benchmarks/disk_cache.py                          # the default model
    .venv/bin/python benchmarks/disk_cache.py --model DIR --prompts 2  # a ~0.5B model
    .venv/bin/python benchmarks/disk_cache.py --model DIR --extra "--tp 2"  # every rank's shards
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

_READY = re.compile(r"pyserve is ready at (http://\S+)")


class Server:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyserve", "run", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if match := _READY.search(line):
                    self.url = match.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> float:
        """Stops it cleanly; returns the seconds the stop took (the disk spill included)."""
        started = time.perf_counter()
        self.proc.terminate()
        self.proc.wait(300)
        return time.perf_counter() - started


def ttft(url: str, ids: list[int]) -> tuple[float, int]:
    """(seconds, cached prompt tokens) of a one-token greedy /generate."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as resp:
        result = json.loads(resp.read())
    return time.perf_counter() - started, result["meta_info"]["cached_tokens"]


def server_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=60) as resp:
        return json.loads(resp.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--vocab", type=int, default=30000, help="token ids are drawn below this")
    p.add_argument("--extra", default="", help="more `pyserve run` options, space-separated")
    args = p.parse_args()

    rng = random.Random(0)
    prompts = [
        [1000 + i] + [rng.randrange(100, args.vocab) for _ in range(args.prompt_tokens - 1)]
        for i in range(args.prompts)
    ]
    state = Path(tempfile.mkdtemp(prefix="pyserve-disk-bench-"))
    base = ["--state-dir", str(state), "--disk-cache-gib", "8", *args.extra.split()]
    if args.model:
        base += ["--model", args.model]

    a = Server(base)
    info = server_info(a.url)
    cold, ram = [], []
    try:
        for ids in prompts:
            cold.append(ttft(a.url, ids))
            ram.append(ttft(a.url, ids))
    finally:
        stop_s = a.stop()
    files = list(state.glob("kv-cache/kv-*/**/*.kv"))  # under --tp, rank r's in rank<r>/
    disk_bytes = sum(f.stat().st_size for f in files)

    b = Server(base)
    try:
        disk = [ttft(b.url, ids) for ids in prompts]
    finally:
        b.stop()

    print(
        f"model {info['model']} ({info['architecture']}), backend {info['backend']['name']}, "
        f"KV {info['kv_cache']['dtype']}, {args.prompt_tokens}-token prompts"
    )
    print(
        f"A's clean stop took {stop_s:.2f} s and left {len(files)} block files, "
        f"{disk_bytes / 2**20:.0f} MiB"
    )
    print(f"{'prompt':>6} {'cold s':>8} {'RAM s':>8} {'disk s':>8} {'cached':>7} "
          f"{'cold/RAM':>9} {'cold/disk':>10}")  # fmt: skip
    for i, ((c, _), (r, _), (d, hit)) in enumerate(zip(cold, ram, disk, strict=True)):
        print(f"{i:>6} {c:8.3f} {r:8.3f} {d:8.3f} {hit:>7} {c / r:9.1f} {c / d:10.1f}")
    med = statistics.median
    c, r, d = med(x[0] for x in cold), med(x[0] for x in ram), med(x[0] for x in disk)
    print(f"median {c:8.3f} {r:8.3f} {d:8.3f} {'':>7} {c / r:9.1f} {c / d:10.1f}")


if __name__ == "__main__":
    main()
