"""Fused RMSNorm, SiLU(gate)·up / GELU-tanh(gate)·up / gpt-oss's clamped SwiGLU and RoPE (with
q/k norm and partial rotary) + KV write on `pyserve._kernels` for the CPU worker, torch
elsewhere.

torch runs RMSNorm as six element-wise ops and SwiGLU's activation as two, each a dispatch and a
pass over memory; a decode step makes ~90 such calls, which at small batches cost as much as a
layer's matmuls. The kernels (cpp/kernels/layer_ops.h) do each in one pass with the same
arithmetic as Hugging Face's modules: float32 sums, and in bfloat16 the same roundings.

They run for float32 and bfloat16 CPU tensors, on CPUs with AVX-512 (elsewhere torch's ops are
as fast as a scalar loop). The CPU kernels backend calls them (``--backend torch`` never does).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pyserve.worker import quant
from pyserve.worker.backends.cpu.attention_kernel import (
    CACHE_DTYPE_CODES,
    DTYPE_CODES,
    scale_addresses,
)
from pyserve.worker.backends.torch.activations import clamped_swiglu

DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take (codes: attention_kernel's)


@functools.cache
def fused_kernels():
    """The compiled module when the fused ops should run here, else None. Looked up at the
    first call, not at import: quant.kernels() sizes the kernels' thread pool from torch's
    thread count, which the worker (or a benchmark) sets after importing the model."""
    try:
        module = quant.kernels()
    except ImportError:
        return None
    return module if module.isa() == "avx512_vnni" else None


def fused_activations() -> frozenset[str]:
    """Gated activations besides SiLU that the fused kernels compute here (e.g. "gelu_tanh"),
    as the module declares them (``pyserve._kernels.GATED_ACTIVATIONS``)."""
    kernels = fused_kernels()
    return frozenset(getattr(kernels, "GATED_ACTIVATIONS", ())) if kernels else frozenset()


def rope_features() -> frozenset[str]:
    """What the fused rope + KV write does beyond rotating whole heads: "qk_norm" (an RMSNorm
    of each q and k head first) and "partial" (rotating a head's first dims only), as the
    module declares them (``pyserve._kernels.ROPE_FEATURES``)."""
    kernels = fused_kernels()
    return frozenset(getattr(kernels, "ROPE_FEATURES", ())) if kernels else frozenset()


def gated_activation(
    gate_up: torch.Tensor, activation: str, *, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """act(gate) · up for the activations of ``fused_activations`` (and silu); torch's ops
    where the kernels do not apply. alpha, limit: the clamped SwiGLU's (ModelConfig's
    swiglu_alpha and swiglu_limit)."""
    if activation == "silu":
        return silu_mul(gate_up)
    if activation == "gelu_tanh":
        return gelu_tanh_mul(gate_up)
    if activation == "clamped_swiglu":
        return clamped_swiglu_mul(gate_up, alpha, limit)
    raise ValueError(f"no fused kernel for the activation {activation!r}")


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as a [rows, width] CPU tensor the kernels take (rows evenly strided, elements
    contiguous), or None when they do not apply."""
    if x.dtype not in DTYPES or x.device.type != "cpu" or fused_kernels() is None:
        return None
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return flat if flat.stride(1) == 1 else flat.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dim, as Hugging Face's LlamaRMSNorm.

    With ``residual`` (x's shape and dtype, updated in place): x + residual is formed first, as
    a decoder block's residual connection does, stored into ``residual`` and normalized, in the
    same pass."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("the residual must have x's shape and dtype")
    flat = _as_rows(x)
    sums = None if residual is None else _as_rows(residual)
    if (
        flat is None
        or weight.dtype != x.dtype
        or not weight.is_contiguous()
        or (residual is not None and (sums is None or sums.data_ptr() != residual.data_ptr()))
    ):
        if residual is not None:
            x = residual.add_(x)
        return F.rms_norm(x, weight.shape, weight, eps)
    rows, hidden = flat.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match rows of {hidden}")
    out = torch.empty(rows, hidden, dtype=x.dtype)
    fused_kernels().rms_norm(
        DTYPE_CODES[x.dtype], flat.data_ptr(), max(flat.stride(0), hidden), rows, hidden,
        weight.data_ptr(), eps, out.data_ptr(), hidden,
        0 if sums is None else sums.data_ptr(), 0 if sums is None else max(sums.stride(0), hidden),
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up = [..., 2·width] holding gate then up (SwiGLU's activation)."""
    return _gated(gate_up, "silu_mul", lambda gate, up: F.silu(gate) * up, fused=True)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) · up for gate_up = [..., 2·width] holding gate then up (Gemma's MLP), with
    gelu_tanh torch's F.gelu(approximate="tanh"): in bfloat16 the activation rounded to bf16
    before the product, as torch's ops round it. The kernel evaluates the same function as
    x·sigmoid(2·inner) (no cancellation for negative x), to a few float32 ulps."""
    fused = "gelu_tanh" in fused_activations()
    return _gated(
        gate_up, "gelu_tanh_mul", lambda g, up: F.gelu(g, approximate="tanh") * up, fused=fused
    )


def clamped_swiglu_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(clamp(up, ±limit) + 1) · g·sigmoid(alpha·g), g = min(gate, limit), for gate_up =
    [..., 2·width] holding gate then up (gpt-oss's experts). The kernel makes torch's ops in
    their order with their roundings (bfloat16: each op's result rounded to bf16), its
    sigmoid within a few float32 ulps of torch's."""
    if not (math.isfinite(alpha) and math.isfinite(limit) and limit > 0):
        raise ValueError(f"clamped SwiGLU: alpha {alpha} and limit {limit} (finite, limit > 0)")
    fused = "clamped_swiglu" in fused_activations()
    return _gated(
        gate_up,
        "clamped_swiglu_mul",
        lambda g, up: clamped_swiglu(g, up, alpha, limit),
        fused=fused,
        options={"alpha": alpha, "limit": limit},
    )


def _gated(
    gate_up: torch.Tensor,
    kernel: str,
    reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    fused: bool,
    options: dict | None = None,
) -> torch.Tensor:
    """act(gate) · up through the kernel ``kernel``, or ``reference(gate, up)`` in torch where
    the kernel cannot take the tensor (or is not built: ``fused`` False)."""
    flat = _as_rows(gate_up)
    if flat is None or flat.shape[1] % 2 or not fused:
        gate, up = gate_up.chunk(2, dim=-1)
        return reference(gate, up)
    rows, width = flat.shape[0], flat.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    getattr(fused_kernels(), kernel)(
        DTYPE_CODES[gate_up.dtype], flat.data_ptr(), max(flat.stride(0), 2 * width), rows, width,
        out.data_ptr(), width, **(options or {}),
    )  # fmt: skip
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], width)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """RoPE on the q and k heads of a float32 fused projection ``qkv`` [T, (heads + 2·kv_heads)
    ·head_dim] (q rotated in place), then k and v stored at ``slots`` (int64 [T]) of one layer's
    cache (kv_cache.py's layouts), in one pass. cos, signed_sin: float32 [T, 1, rotary_dim] from
    RotaryTable.cos_sin; with rotary_dim < head_dim only each head's first rotary_dim dims
    rotate (rope.apply_rope's partial rotary). q_norm, k_norm: float32 [head_dim] weights of a
    per-head RMSNorm (eps) of every q and k head before the rotation (Qwen3's), each optional.
    An int8 cache takes each head quantized in groups of 32 (kv_cache.quantize_int8's numerics)
    and their float16 scales into ``k_scale`` / ``v_scale`` (kv_cache.py's layouts).
    Returns False, touching nothing, where the kernel does not apply (then normalize with
    F.rms_norm, rotate with rope.apply_rope and write with PagedKVCache.write)."""
    kernels = fused_kernels()
    norms = [w for w in (q_norm, k_norm) if w is not None]
    needs = {"qk_norm"} if norms else set()
    if (
        kernels is None
        or qkv.dtype != torch.float32
        or cos.dtype != torch.float32
        or signed_sin.dtype != torch.float32
        or k_cache.dtype not in CACHE_DTYPE_CODES
        or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in norms)
    ):
        return False
    if k_cache.dtype == torch.int8:
        needs.add("int8_q8_0")
    rows, width = qkv.shape
    kv_heads, num_blocks, block_size, head_dim = v_cache.shape
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"rope_write_kv: eps must be finite and >= 0, not {eps}")
    rotary_dim = cos.shape[-1] if cos.dim() else 0
    if rotary_dim != head_dim:
        needs.add("partial")
    if not needs <= rope_features():
        return False
    if (
        qkv.stride(1) != 1
        or width != (num_heads + 2 * num_kv_heads) * head_dim
        or kv_heads != num_kv_heads
        or k_cache.shape != (kv_heads, num_blocks, head_dim, block_size)
        or k_cache.dtype != v_cache.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or not (cos.is_contiguous() and signed_sin.is_contiguous())
        or not (2 <= rotary_dim <= head_dim and rotary_dim % 2 == 0)
        or cos.numel() != rows * rotary_dim
        or signed_sin.shape != cos.shape
        or any(w.shape != (head_dim,) or not w.is_contiguous() for w in norms)
        or slots.dtype != torch.int64
        or slots.shape != (rows,)
        or not slots.is_contiguous()
    ):
        raise ValueError("rope_write_kv: the projection, tables, slots and caches do not agree")
    kernels.rope_write_kv(
        qkv.data_ptr(), max(qkv.stride(0), width), rows, num_heads, num_kv_heads, head_dim,
        cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), CACHE_DTYPE_CODES[k_cache.dtype], num_blocks, block_size,
        **_rope_options(rotary_dim, head_dim, q_norm, k_norm, eps),
        **_scale_options(k_cache, k_scale, v_scale),
    )  # fmt: skip
    return True


def _scale_options(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> dict:
    """The kernel's keywords for an int8 cache's scales (none for a float cache)."""
    k_at, v_at = scale_addresses(k_cache, k_scale, v_scale)
    return {"k_scale": k_at, "v_scale": v_at} if k_at else {}


def _rope_options(
    rotary_dim: int,
    head_dim: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> dict:
    """The kernel's keywords for partial rotary and the q/k norm, only those in use (a module
    without the features takes the plain call)."""
    options: dict = {}
    if rotary_dim != head_dim:
        options["rotary_dim"] = rotary_dim
    if q_norm is not None or k_norm is not None:
        options.update(eps=eps, q_norm=0 if q_norm is None else q_norm.data_ptr(),
                       k_norm=0 if k_norm is None else k_norm.data_ptr())  # fmt: skip
    return options
