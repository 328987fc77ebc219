"""Backends: how the worker computes its model's ops, one package each (torch/, cpu/, triton/,
base.py says what a backend owns), registered here by name.

``select_backend`` runs once when the worker starts and says why it chose what it chose: for
``auto``, each registered backend says whether the device is its own and whether it runs there
(``Backend.auto_choice``); the CPU kernels backend then decides, in one place
(cpu/backend.py's KernelPlan), which of its kernels run. This module imports no torch: the main
process reads the names from it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pyserve.worker.backends.base import Backend
    from pyserve.worker.models.config import ModelConfig

# name → "module:class" of the backend (imported when selected), in the order ``auto`` asks them;
# the last, the torch reference, runs on any device and wherever another cannot
REGISTRY = {
    "cpu-kernels": "pyserve.worker.backends.cpu.backend:CpuKernelsBackend",
    "triton": "pyserve.worker.backends.triton.backend:TritonBackend",
    "torch": "pyserve.worker.backends.torch.backend:TorchBackend",
}
BACKEND_NAMES = ("auto", *REGISTRY)  # what --backend takes


def backend_class(name: str) -> type[Backend]:
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def select_backend(
    setting: str, config: ModelConfig, device: torch.device, **options: object
) -> Backend:
    """The backend for ``setting`` (auto or a registered name) on ``device``, with its reason.

    auto: the Triton kernels on a CUDA device (where triton is installed), the CPU kernels on a
    CPU whose instruction set they vectorize (AVX-512 VNNI or AVX2), the torch reference
    elsewhere (other devices, or a CPU where only the portable loops would run: torch's own
    kernels are faster there)."""
    if setting == "auto":
        cls, reason = _auto(device)
    elif setting in REGISTRY:
        cls = backend_class(setting)
        reason = cls.asked_for(device)
    else:
        names = ", ".join(BACKEND_NAMES[:-1])
        raise ValueError(f"backend must be {names} or {BACKEND_NAMES[-1]}; got {setting!r}")
    return cls(config, device, reason, **options)  # type: ignore[arg-type]


def _auto(device: torch.device) -> tuple[type[Backend], str]:
    fallback = backend_class(next(reversed(REGISTRY)))
    for name in REGISTRY:
        cls = backend_class(name)
        choice = cls.auto_choice(device)
        if choice is not None:
            runs, reason = choice
            return (cls if runs else fallback), reason
    raise AssertionError("the last backend claims every device")


def attention_backend(
    kind: str,
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,
    softcap: float | None = None,
    kv_dtype: torch.dtype | None = None,
    **options: object,
) -> Backend:
    """A backend ("cpu-kernels" or "torch") for attention alone, with its cache allocated (tests
    and benchmarks fill it) in ``kv_dtype`` (None: ``dtype``); ``options`` go to the backend
    (e.g. ``max_chunk_tokens``)."""
    import torch

    from pyserve.worker.models.config import ModelConfig, RopeConfig, uniform_layers

    config = ModelConfig(
        architecture="llama",
        vocab_size=16,
        hidden_size=heads * dim,
        intermediate_size=16,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        rms_norm_eps=1e-5,
        context_length=1 << 16,
        tie_word_embeddings=False,
        layers=uniform_layers(num_layers, RopeConfig(10000.0, dim), window),
        attn_softcap=softcap,
    )
    backend = select_backend(kind, config, torch.device("cpu"), **options)
    backend.allocate_kv_cache(num_blocks, block_size, kv_dtype or dtype)
    return backend
