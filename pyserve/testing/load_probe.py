"""How much memory loading a model takes: loads it as the worker does and prints one JSON line.

    python -m pyserve.testing.load_probe MODEL [--quantization auto] [--dtype auto]
        [--num-blocks 64]

``before``: the process's RSS once the libraries are imported (torch, transformers, gguf),
``peak``: its peak RSS once the model and a KV pool of ``--num-blocks`` blocks are loaded,
``kv``: the pool's bytes, ``precisions``: projections packed at each precision, ``seconds``.
Run in a fresh process per model: the peak of a process never goes down.
"""

from __future__ import annotations

import argparse
import json
import time


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def probe(
    model: str | None, quantization: str, dtype: str, num_blocks: int, block_size: int
) -> dict:
    import gguf  # noqa: F401 (imported before the first figure, as the worker has them)
    import safetensors  # noqa: F401
    import transformers.models.auto.configuration_auto  # noqa: F401

    from pyserve.worker.model_runner import ModelRunner
    from pyserve.worker.settings import WorkerSettings

    before = _status("VmRSS:")
    started = time.perf_counter()
    settings = WorkerSettings(
        model=model,
        num_blocks=num_blocks,
        block_size=block_size,
        quantization=quantization,
        dtype=dtype,
    )
    runner = ModelRunner(settings)
    return {
        "before": before,
        "peak": _status("VmHWM:"),
        "kv": runner.kv_cache_bytes,
        "precisions": runner.packed_precisions,
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pyserve.testing.load_probe")
    p.add_argument("model", nargs="?", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    got = probe(args.model, args.quantization, args.dtype, args.num_blocks, args.block_size)
    print(json.dumps(got))


if __name__ == "__main__":
    main()
