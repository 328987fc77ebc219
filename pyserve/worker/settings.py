"""WorkerSettings: what the worker loads and how it runs it, in one object from the engine (or
an embedder, a test, a benchmark) to the model runner. Torch-free, so the main process builds it.
"""

from __future__ import annotations

import msgspec

# how the worker computes (--backend): auto, the fastest this machine and model allow, decided
# once at start; or a backend by name (pyserve/worker/backends/__init__.py registers them)
from pyserve.worker.backends import BACKEND_NAMES
from pyserve.worker.dtypes import (
    ACTIVATION_BITS,
    DTYPE_NAMES,
    KV_STORED_DTYPES,
    resolve_quantization,
)


def tp_split_problem(size: int, counts: dict[str, int]) -> str | None:
    """Why ``size`` tensor-parallel ranks cannot split a model with these ``counts`` ({"attention
    heads": 9, ...}), or None."""
    bad = [f"{what} {n}" for what, n in counts.items() if n % size]
    if not bad:
        return None
    verb = "is" if len(bad) == 1 else "are"
    return f"--tp {size} cannot split this model: {', '.join(bad)} {verb} not divisible by {size}"


class WorkerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None  # HF directory or .gguf file; None = the bundled SmolLM2
    # a smaller model (a path like ``model``) that drafts tokens for worker-drafted verify
    # entries; it shares the KV pool's block ids and the vocabulary. None: no draft model
    draft_model: str | None = None
    # llama.cpp's --mmproj: a GGUF vision tower and projector for a GGUF ``model``; None: the
    # model's own tower (a Hugging Face directory's), if any
    mmproj: str | None = None
    # what the image tower computes in; auto: ``dtype`` (its outputs join the model's embeddings
    # in ``dtype`` either way)
    vision_dtype: str = "auto"
    num_blocks: int = 1024  # KV pool size, in blocks (the core's BlockAllocator has as many)
    block_size: int = 16
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    kv_cache_dtype: str | None = None  # None: the model's dtype; int8: quantized with scales
    quantization: str = "none"  # none | int8 | int4 | auto (the runner resolves auto)
    activation_bits: int = 16  # quantized layers' activations: 16 or 8 (llama.cpp's Q8_1)
    device: str = "cpu"
    backend: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    seed: int | None = None  # seeds the draws of requests that bring no seed of their own
    # on a CUDA device: size the KV pool (instead of num_blocks) so that the worker holds this
    # fraction of the device's memory once the weights are loaded
    mem_fraction_static: float | None = None
    # the disk tier under the prefix cache: the base directory of its block files ("": no disk
    # tier; the worker uses ``<dir>/kv-<fingerprint>/``) and the bytes it may hold (the core
    # keeps within them)
    disk_cache_dir: str = ""
    disk_cache_bytes: int = 0

    def validate(self) -> None:
        """Raises ValueError on settings that cannot work, before anything loads."""
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype {self.dtype!r} is not supported (auto, {', '.join(DTYPE_NAMES)})"
            )
        if self.vision_dtype != "auto" and self.vision_dtype not in DTYPE_NAMES:
            raise ValueError(
                f"vision_dtype {self.vision_dtype!r} is not supported "
                f"(auto, {', '.join(DTYPE_NAMES)})"
            )
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_STORED_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported "
                f"({', '.join(KV_STORED_DTYPES)})"
            )
        if self.activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits must be 8 or 16, not {self.activation_bits}")
        # an unknown name, or int4/int8 off the CPU
        resolve_quantization(self.quantization, self.device, None)
        if self.backend not in BACKEND_NAMES:
            raise ValueError(
                f"backend must be one of {', '.join(BACKEND_NAMES)}; got {self.backend!r}"
            )
        if self.backend == "cpu-kernels" and not self.device.startswith("cpu"):
            raise ValueError(f"backend cpu-kernels runs on the CPU only (device {self.device!r})")
        if self.mem_fraction_static is not None:
            if not self.device.startswith("cuda"):
                raise ValueError("mem_fraction_static sizes the KV pool on a CUDA device only")
            if not 0.0 < self.mem_fraction_static < 1.0:
                raise ValueError(
                    f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
                )
        if self.disk_cache_bytes < 0:
            raise ValueError(f"disk_cache_bytes must be >= 0, got {self.disk_cache_bytes}")
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(
                f"num_blocks={self.num_blocks} and block_size={self.block_size} must be >= 1"
            )
