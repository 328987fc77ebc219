"""Fused RMSNorm and SiLU(gate)·up on `pyserve._kernels` for the CPU worker, torch elsewhere.

torch runs RMSNorm as six element-wise ops and SwiGLU's activation as two, each a dispatch and a
pass over memory; a decode step makes ~90 such calls, which at small batches cost as much as a
layer's matmuls. The kernels (cpp/kernels/layer_ops.h) do each in one pass with the same
arithmetic as Hugging Face's modules: float32 sums, and in bfloat16 the same roundings.

They run for float32 and bfloat16 CPU tensors, on CPUs with AVX-512 (elsewhere torch's ops are
as fast as a scalar loop). ``PYSERVE_LAYER_OPS=torch`` forces torch.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pyserve.worker import quant
from pyserve.worker.attention_kernel import DTYPE_CODES

ENV = "PYSERVE_LAYER_OPS"  # "torch": never the fused kernels
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take (codes: attention_kernel's)


@functools.cache
def fused_kernels():
    """The compiled module when the fused ops should run here, else None. Looked up at the
    first call, not at import: quant.kernels() sizes the kernels' thread pool from torch's
    thread count, which the worker (or a benchmark) sets after importing the model."""
    if os.environ.get(ENV, "").lower() == "torch":
        return None
    try:
        module = quant.kernels()
    except ImportError:
        return None
    return module if module.isa() == "avx512_vnni" else None


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as a [rows, width] CPU tensor the kernels take (rows evenly strided, elements
    contiguous), or None when they do not apply."""
    if x.dtype not in DTYPES or x.device.type != "cpu" or fused_kernels() is None:
        return None
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return flat if flat.stride(1) == 1 else flat.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dim, as Hugging Face's LlamaRMSNorm."""
    flat = _as_rows(x)
    if flat is None or weight.dtype != x.dtype or not weight.is_contiguous():
        return F.rms_norm(x, weight.shape, weight, eps)
    rows, hidden = flat.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match rows of {hidden}")
    out = torch.empty(rows, hidden, dtype=x.dtype)
    fused_kernels().rms_norm(
        DTYPE_CODES[x.dtype], flat.data_ptr(), max(flat.stride(0), hidden), rows, hidden,
        weight.data_ptr(), eps, out.data_ptr(), hidden,
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up = [..., 2·width] holding gate then up (SwiGLU's activation)."""
    flat = _as_rows(gate_up)
    if flat is None or flat.shape[1] % 2:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, width = flat.shape[0], flat.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    fused_kernels().silu_mul(
        DTYPE_CODES[gate_up.dtype], flat.data_ptr(), max(flat.stride(0), 2 * width), rows, width,
        out.data_ptr(), width,
    )  # fmt: skip
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], width)
