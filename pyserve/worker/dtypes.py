"""The dtype a device computes fastest in. Torch-free, so the main process can ask too.

Measured with benchmarks/bench_worker.py (benchmarks/RESULTS.md, "Worker"): on a CPU with native
bf16 instructions (AVX512-BF16) the SmolLM2 worker decodes and prefills faster in bfloat16 than
in float32 at every batch size, and bf16 halves the KV cache. Without those instructions torch
emulates bf16 and float32 is the faster choice. float32 remains the exact mode (it matches
transformers' logprobs to 1e-4); GPUs compute in bf16 natively.

With quantized linear layers (int4/int8 on pyserve._kernels) auto is float32 on the CPU: the
kernel takes and returns float32 activations, so a bf16 model pays two conversions per linear.
Measured the same way (default model, int4): float32 decodes faster at batch 1 and about as
fast at larger batches (bf16 slightly ahead at some), prefill is even; and float32 keeps the
logits within 0.002 of unquantized float32 (int16 activations). The engine sizes the KV pool
in the same float32 (EngineConfig.resolved_dtype), before the worker knows what auto
quantization means.
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


def default_dtype(device: str, quantization: str = "none") -> str:
    """What ``dtype="auto"`` means on ``device`` with linear layers quantized as given."""
    if device.startswith("cpu"):
        if quantization != "none":
            return "float32"  # MEASURED: see the module docstring
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return "bfloat16"


# ---------------------------------------------------------------------------- KV cache

# int8: symmetric int8 values with a float16 scale per 32 values of a (token, kv head) of K and
# of V (llama.cpp's q8_0; pyserve/worker/kv_cache.py); the others store K and V as they are,
# rounded to the dtype
KV_STORED_DTYPES = (*DTYPE_NAMES, "int8")
KV_CACHE_DTYPE_NAMES = ("auto", *KV_STORED_DTYPES)
# bytes per stored value, and per scale (of a group of 32 values) of K or of V
KV_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
KV_SCALE_BYTES = {"int8": 2}
KV_INT8_GROUP = 32  # values per scale in an int8 cache (llama.cpp's q8_0 block)


def kv_int8_groups(head_dim: int) -> int:
    """The scales per (token, head) of an int8 cache: one per KV_INT8_GROUP values, rounded up."""
    return -(-head_dim // KV_INT8_GROUP)


def kv_scale_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of the scales of one token's K (or V) in one kv head: a quantized cache's."""
    return kv_int8_groups(head_dim) * KV_SCALE_BYTES.get(kv_dtype, 0)


def kv_bytes_per_token_head(kv_dtype: str, head_dim: int) -> int:
    """Bytes one token's K (or V) takes in one kv head, its scales included."""
    return head_dim * KV_VALUE_BYTES[kv_dtype] + kv_scale_bytes(kv_dtype, head_dim)


def resolve_kv_cache_dtype(setting: str, device: str, model_dtype: str) -> str:
    """What ``kv_cache_dtype=setting`` means for a model computing in ``model_dtype``.

    ``auto`` stores a float32 model's K and V in float16 on the CPU, as llama.cpp does by
    default, and in the model's dtype otherwise. A CPU decode step at 32 streams reads every
    running request's whole cache once per layer at memory speed; in float32 that was a large
    share of the worker's time under a many-stream load, and float16 halves it. float16
    keeps 11 significant bits (relative rounding 2^-11; bf16 keeps 8) and covers ±65504, far
    beyond the keys and values of the models served here. Pass ``float32`` for the exact mode.
    ``int8`` is only ever asked for: it halves float16's bytes again at a measured cost in
    drift (benchmarks/RESULTS.md).
    """
    if setting not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}; got {setting!r}"
        )
    if setting != "auto":
        return setting
    return "float16" if device.startswith("cpu") and model_dtype == "float32" else model_dtype


# ---------------------------------------------------------------------------- quantization

# What quantized layers round activations to: 16 (default; logits within ~0.001 of float32 over
# the same weights) or 8 (llama.cpp's Q8_1 numerics, faster from ~8 rows on)
ACTIVATION_BITS = (16, 8)

QUANTIZATION_NAMES = ("auto", "none", "int8", "int4")
QUANTIZED_MODES = ("int8", "int4")


QUANTIZED_DEVICES = ("cpu", "cuda")  # pyserve._kernels on the CPU, Triton kernels on CUDA


def resolve_quantization(setting: str, device: str, checkpoint_hint: str | None) -> str:
    """What ``quantization=setting`` means for a checkpoint on ``device``: none, int8 or int4.

    ``auto`` serves a GGUF at the precision its file holds (``checkpoint_hint``, from the
    loader) where quantized kernels exist: the CPU (pyserve._kernels) and CUDA devices
    (pyserve/worker/backends/triton/quant_matmul.py); unquantized elsewhere.
    """
    if setting not in QUANTIZATION_NAMES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_NAMES)}; got {setting!r}"
        )
    has_kernels = device.startswith(QUANTIZED_DEVICES)
    if setting == "auto":
        return checkpoint_hint if has_kernels and checkpoint_hint in QUANTIZED_MODES else "none"
    if setting in QUANTIZED_MODES and not has_kernels:
        raise ValueError(
            f"quantization {setting} runs on CPU and CUDA devices only (device {device!r}); "
            "use --quantization none or auto"
        )
    return setting
