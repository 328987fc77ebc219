"""The dtype a device computes fastest in. Torch-free, so the main process can ask too.

Measured with benchmarks/bench_worker.py (benchmarks/RESULTS.md, "Worker"): on a CPU with native
bf16 instructions (AVX512-BF16 here) the SmolLM2 worker decodes 1.5x faster in bfloat16 than in
float32 at batch 1 and 2.2x from batch 8 up, prefills 1.7x faster, and bf16 halves the KV cache.
Without those instructions torch emulates bf16 and float32 is the faster choice. float32 remains
the exact mode (it matches transformers' logprobs to 1e-4); GPUs compute in bf16 natively.
"""

from __future__ import annotations

import functools
import sys

DTYPE_NAMES = ("float32", "bfloat16", "float16")
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in _NATIVE_BF16_FLAGS)
    except OSError:
        pass
    return False


def default_dtype(device: str) -> str:
    """What ``dtype="auto"`` means on ``device``."""
    if device.startswith("cpu"):
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return "bfloat16"
