"""Backends: how the worker computes its model's ops (base.py), and the choice of one.

``select_backend`` runs once when the worker starts and says why it chose what it chose; the CPU
kernels backend then decides, in one place (cpu/backend.py's KernelPlan), which of its kernels run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyserve.worker.backends.base import AttentionLayer, Backend, BackendInfo, QKNorm
from pyserve.worker.models.config import ModelConfig

if TYPE_CHECKING:  # at run time this package's name torch is its torch/ subpackage
    import torch

__all__ = [
    "AttentionLayer",
    "Backend",
    "BackendInfo",
    "QKNorm",
    "attention_backend",
    "select_backend",
]


def _kernels_isa() -> str | None:
    from pyserve.worker.backends.cpu.attention_kernel import kernel_available

    if not kernel_available():
        return None
    from pyserve.worker import quant

    return quant.kernels().isa()


_ISA_NAMES = {"avx512_vnni": "AVX-512 VNNI", "avx2": "AVX2", "scalar": "portable loops"}


def select_backend(
    setting: str, config: ModelConfig, device: torch.device, **options: object
) -> Backend:
    """The backend for ``setting`` (auto | cpu-kernels | triton | torch) on ``device``, with its
    reason.

    auto: the Triton kernels on a CUDA device (where triton is installed), the CPU kernels on a
    CPU whose instruction set they vectorize (AVX-512 VNNI or AVX2), the torch reference
    elsewhere (other devices, or a CPU where only the portable loops would run: torch's own
    kernels are faster there)."""
    from pyserve.worker.backends.cpu.backend import CpuKernelsBackend
    from pyserve.worker.backends.torch.attention import TorchBackend
    from pyserve.worker.backends.triton.backend import TritonBackend, triton_usable

    if setting == "triton":
        return TritonBackend(config, device, "asked for (--backend triton)", **options)  # type: ignore[arg-type]
    if setting == "auto" and device.type == "cuda":
        problem = triton_usable(device)
        if problem is None:
            return TritonBackend(config, device, "a CUDA device", **options)  # type: ignore[arg-type]
        return TorchBackend(config, device, problem, **options)  # type: ignore[arg-type]
    if setting == "torch":
        return TorchBackend(config, device, "asked for (--backend torch)", **options)  # type: ignore[arg-type]
    isa = _kernels_isa() if device.type == "cpu" else None
    if setting == "cpu-kernels":
        if device.type != "cpu":
            raise ValueError(f"the cpu-kernels backend runs on the CPU, not {device}")
        if isa is None:
            raise ValueError("the cpu-kernels backend needs pyserve._kernels, which did not import")
        return CpuKernelsBackend(
            config, device, f"asked for ({_ISA_NAMES.get(isa, isa)})", **options
        )  # type: ignore[arg-type]
    if setting != "auto":
        raise ValueError(f"backend must be auto, cpu-kernels, triton or torch; got {setting!r}")
    if device.type != "cpu":
        return TorchBackend(
            config, device, f"device {device.type}: no kernels of ours run there", **options
        )  # type: ignore[arg-type]
    if isa is None:
        return TorchBackend(config, device, "pyserve._kernels did not import", **options)  # type: ignore[arg-type]
    if isa == "scalar":
        return TorchBackend(config, device, "no AVX2 on this CPU", **options)  # type: ignore[arg-type]
    return CpuKernelsBackend(config, device, _ISA_NAMES.get(isa, isa), **options)  # type: ignore[arg-type]


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
    **options: object,
) -> Backend:
    """A backend ("cpu-kernels" or "torch") for attention alone, with its cache allocated (tests
    and benchmarks fill it); ``options`` go to the backend (e.g. ``max_chunk_tokens``)."""
    from pyserve.worker.models.config import RopeConfig, uniform_layers

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
    import torch

    backend = select_backend(kind, config, torch.device("cpu"), **options)
    backend.allocate_kv_cache(num_blocks, block_size, dtype)
    return backend
