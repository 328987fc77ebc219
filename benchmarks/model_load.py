"""Loading real model files: peak memory, time to a healthy server beside llama.cpp's, and the
logit drift of K-quant files served at their own precision.

The files are kquant_files.py's: random-weight Llama models of ~0.5B and ~3B parameters as bf16
safetensors directories and as Q4_K_M GGUFs made by llama.cpp's own ``llama-quantize``.

- memory: each file loaded as the worker loads it, in a fresh process
  (``python -m pyserve.testing.load_probe``), against the bound of 1.3x the file's size + the KV
  pool + 300 MB; the GGUF with the defaults, the safetensors directory unquantized (bf16 on
  this CPU) and with --quantization int4.
- start: ``pyserve run`` and llama.cpp's ``llama-server`` (compare.py's build and flags) on the
  same GGUF, each started ``--starts`` times (6), taking turns, seconds from the process's
  start to a 200 from /health (polled every 50 ms); the median of all starts but the first
  (caches warm) is the figure compared.
- drift: prefill logits of the GGUF served with the defaults (each projection at its file's
  precision, int16 activations) against the same file with ``--quantization none`` in float32
  (its exact dequantized weights, which tests hold equal to transformers' loading of a GGUF),
  over random prompts: top-1 agreement, |Δ logprob| of the exact top token, KL.

    .venv/bin/python benchmarks/model_load.py                       # both sizes, all parts
    .venv/bin/python benchmarks/model_load.py --sizes 0.5b --parts memory,start
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import (  # noqa: E402 (after the path: benchmarks/ is not a package)
    RunningServer,
    find_llama_server,
    llamacpp_spec,
    pyserve_spec,
    stop_all,
)
from kquant_files import model_files  # noqa: E402

PARTS = ("memory", "start", "drift")
MB = 1e6


def load_probe(model: str, quantization: str, dtype: str = "auto") -> dict:
    options = ["--quantization", quantization, "--dtype", dtype]
    done = subprocess.run(
        [sys.executable, "-m", "pyserve.testing.load_probe", model, *options],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def file_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def memory(size: str, files: dict) -> list[str]:
    rows = []
    cases = [
        (files["gguf"], "auto", "auto"),
        (files["hf"], "none", "auto"),
        (files["hf"], "int4", "auto"),
    ]
    for path, quantization, dtype in cases:
        path = Path(path)
        got = load_probe(str(path), quantization, dtype)
        size_b = file_bytes(path)
        bound = 1.3 * size_b + got["kv"] + 300 * MB
        kind = "GGUF Q4_K_M" if path.suffix == ".gguf" else "bf16 safetensors"
        precisions = ", ".join(f"{n} {b}" for b, n in got["precisions"].items()) or "float"
        rows.append(
            f"| {size} | {kind} | {quantization} | {size_b / MB:.0f} | {got['before'] / MB:.0f} "
            f"| {got['peak'] / MB:.0f} | {(got['peak'] - got['before']) / MB:.0f} "
            f"| {got['kv'] / MB:.0f} | {bound / MB:.0f} | "
            f"{'yes' if got['peak'] <= bound else 'NO'} | {got['seconds']:.1f} | {precisions} |"
        )
        print(rows[-1], flush=True)
    return rows


MEMORY_HEADER = (
    "| model | file | --quantization | file MB | RSS before MB | peak RSS MB | added MB | KV MB "
    "| bound MB | within | load s | projections |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def start_times(gguf: str, out_dir: Path, llama_server: str | None, starts: int) -> list[str]:
    """Each server started ``starts`` times, the servers taking turns (a noisy VM slows both
    alike): the first start, and the median of the others (caches warm)."""
    specs = [pyserve_spec("pyserve", [], gguf)]
    binary = find_llama_server(llama_server)
    if binary:
        specs.append(llamacpp_spec(binary, gguf))
    seconds: dict[str, list[float]] = {}
    for attempt in range(starts):
        for spec in specs:
            server = RunningServer(spec, out_dir / f"start-{spec.name}-{attempt}.log")
            try:
                seconds.setdefault(spec.name, []).append(server.wait_ready(poll_s=0.05))
            finally:
                server.stop()
            print(f"[{spec.name}] start {attempt + 1}: {seconds[spec.name][-1]:.2f} s", flush=True)
    warm = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    rows = [
        f"| {Path(gguf).parent.name} | {name} | {s[0]:.2f} | {warm[name]:.2f} "
        f"({min(s[1:]):.2f}–{max(s[1:]):.2f}) |"
        for name, s in seconds.items()
    ]
    if "llama.cpp" in seconds:
        ratio = warm["pyserve"] / warm["llama.cpp"]
        rows.append(f"| | pyserve / llama.cpp, median of later starts | | {ratio:.2f}x |")
    return rows


START_HEADER = (
    "| model | server | first start s | later starts s, median (range) |\n|---|---|---|---|"
)


def drift(size: str, gguf: str, prompts: int, length: int) -> str:
    import torch

    from pyserve.worker.batch import ForwardBatch
    from pyserve.worker.model_runner import ModelRunner
    from pyserve.worker.settings import WorkerSettings

    def load(**kw) -> ModelRunner:
        return ModelRunner(WorkerSettings(model=gguf, num_blocks=-(-length // 16), **kw))

    def logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
        return runner.forward(ForwardBatch.whole_prompt(prompt, runner.block_size)).float()

    gen = torch.Generator().manual_seed(0)
    served = load(quantization="auto")
    vocab = served.config.vocab_size
    batch = [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(prompts)]
    got = torch.cat([logits(served, p) for p in batch])
    precisions = served.packed_precisions
    del served
    exact_runner = load(quantization="none", dtype="float32", kv_cache_dtype="float32")
    ref = torch.cat([logits(exact_runner, p) for p in batch])
    del exact_runner
    ref_lp, new_lp = ref.log_softmax(-1), got.log_softmax(-1)
    top = ref.argmax(-1, keepdim=True)
    agree = got.argmax(-1) == top[:, 0]
    drop = (new_lp.gather(1, top) - ref_lp.gather(1, top)).abs()[:, 0]
    kl = (ref_lp.exp() * (ref_lp - new_lp)).sum(-1)
    top2 = ref_lp.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1])[~agree]
    shown = ", ".join(f"{n} {b}" for b, n in precisions.items())
    return (
        f"| {size} | {shown} | {len(ref)} | {agree.float().mean() * 100:.1f}% | "
        f"{drop.mean():.4f} / {drop.max():.3f} | {kl.mean():.5f} / {kl.max():.4f} | "
        + (f"{gaps.max():.3f}" if len(gaps) else "—")
        + " |"
    )


DRIFT_HEADER = (
    "| model | projections | positions | top-1 agreement with the exact model | "
    "abs Δ logprob of its top token, mean / max | KL(exact‖served), mean / max | "
    "largest exact top-2 gap where top-1 differs |\n|---|---|---|---|---|---|---|"
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5b,3b")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--out", type=Path, default=HERE / "out" / "kquant-models")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--starts", type=int, default=6, help="starts of each server, alternating")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--length", type=int, default=64)
    args = p.parse_args()
    parts = args.parts.split(",")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"model_load.py {' '.join(sys.argv[1:])} ({started})")
    sections: dict[str, list[str]] = {part: [] for part in parts}
    try:
        for size in args.sizes.split(","):
            files = model_files(size, args.out / size)
            files = {"gguf": files["gguf"], "hf": files["hf_dir"]}
            if "memory" in parts:
                sections["memory"] += memory(size, files)
            if "start" in parts:
                out_dir = args.out / size / "start-logs"
                sections["start"] += start_times(
                    files["gguf"], out_dir, args.llama_server, args.starts
                )
            if "drift" in parts:
                sections["drift"].append(drift(size, files["gguf"], args.prompts, args.length))
                print(sections["drift"][-1], flush=True)
    finally:
        stop_all()
    headers = {"memory": MEMORY_HEADER, "start": START_HEADER, "drift": DRIFT_HEADER}
    for part, rows in sections.items():
        print(f"\n{headers[part]}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
