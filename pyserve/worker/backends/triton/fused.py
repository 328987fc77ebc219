"""Fused element-wise ops in Triton: RMSNorm (with the residual add), gated activations, and
RoPE with the K/V store into the paged cache (``attention.py`` has the cache's layout), which
quantizes each token's heads for an int8 cache as kv_cache.quantize_int8 does.

Each computes in float32 and stores in its output's dtype, as the torch reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyserve.worker.backends.triton.kv_int8 import check_int8_scales, int8_block_groups
from pyserve.worker.dtypes import kv_int8_groups

# jit code reads module globals only when they are constexprs (the interpreter reads any)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INT8_MAX = tl.constexpr(127.0)
_FLOAT16_MAX = tl.constexpr(65504.0)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, width, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(residual_ptr + row * width + cols, x.to(residual_ptr.dtype.element_ty), mask=ok)
    mean_square = tl.sum(x * x, axis=0) / width
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = x / tl.sqrt(mean_square + eps) * weight
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dim; with ``residual``, residual += x
    (in place) first and the sum is normalized."""
    width = x.shape[-1]
    x2 = x.reshape(-1, width).contiguous()
    out = torch.empty_like(x2)
    if residual is not None and not residual.is_contiguous():
        raise ValueError("the residual must be contiguous: it is updated in place")
    _rms_norm_kernel[(x2.shape[0],)](
        x2, residual if residual is not None else x2, weight, out, width, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(width),
    )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _gated_kernel(
    x_ptr, out_ptr, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + cols, mask=ok, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate)
    else:  # gelu_tanh: 0.5·g·(1 + tanh(y)) = g·sigmoid(2y)
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    tl.store(out_ptr + row * width + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


ACTIVATIONS = ("silu", "gelu_tanh")  # the others run in torch (backends/torch/activations.py)


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) · up for gate_up = [..., 2·width] holding gate then up."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported")
    width = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * width).contiguous()
    out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    _gated_kernel[(x.shape[0], triton.cdiv(width, block))](
        x, out, width, ACTIVATION=activation, BLOCK=block
    )
    return out.view(*gate_up.shape[:-1], width)


@triton.jit
def _rotated(row_ptr, heads, head_ok, dims, cos, sin, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr):
    """One token's heads [BLOCK_H, BLOCK_D] from ``row_ptr``, the first ROTARY dims rotated
    (rotate-half: dim i pairs with i + ROTARY/2)."""
    ok = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    x = tl.load(row_ptr + heads[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0)
    half = ROTARY // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    rotary = dims < ROTARY
    xp = tl.load(
        row_ptr + heads[:, None] * HEAD_DIM + partner[None, :],
        mask=ok & rotary[None, :],
        other=0.0,
    )
    x = x.to(tl.float32)
    turned = x * cos[None, :] + xp.to(tl.float32) * sin[None, :]
    return tl.where(rotary[None, :], turned, x), ok


@triton.jit
def _rounded_half_even(y):
    """round(y), ties to even, as torch.round: tl has no rint that the interpreter runs too."""
    lower = tl.floor(y)
    above = y - lower  # exact: lower is y's floor
    odd = lower * 0.5 != tl.floor(lower * 0.5)
    up = (above > 0.5) | ((above == 0.5) & odd)
    return lower + up.to(tl.float32)


@triton.jit
def _quantized(x, BLOCK_G: tl.constexpr):
    """Each row of x [R, D] (float32, zeros where masked) as kv_cache.quantize_int8 gives it,
    in BLOCK_G groups of D / BLOCK_G values: int8 values round(x · (1 / s)) [R, D] and the
    float16 scales s = max|x| / 127 [R, BLOCK_G], clamped to float16's range and rounded to
    nearest even (0, and values 0, for a group of zeros or one whose scale underflows). Both
    divisions are correctly rounded, as torch's are; ``/`` on a GPU is not."""
    rows: tl.constexpr = x.shape[0]
    width: tl.constexpr = x.shape[1] // BLOCK_G
    grouped = tl.reshape(x, (rows, BLOCK_G, width))
    wide = tl.math.div_rn(tl.max(tl.abs(grouped), axis=2), _INT8_MAX)
    scale = tl.minimum(wide, _FLOAT16_MAX).to(tl.float16)  # round to nearest even
    stored = scale.to(tl.float32)
    nonzero = stored > 0
    inverse = tl.where(nonzero, tl.math.div_rn(1.0, tl.where(nonzero, stored, 1.0)), 0.0)
    q = _rounded_half_even(grouped * inverse[:, :, None])
    q = tl.minimum(tl.maximum(q, -_INT8_MAX), _INT8_MAX)
    return tl.reshape(q, (rows, BLOCK_G * width)).to(tl.int8), scale


@triton.jit
def _store_kv(
    cache_ptr, scale_ptr, x, slot, kv_heads, ok, dims,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr, QUANTIZED: tl.constexpr,
):  # fmt: skip
    """One token's kv heads x [BLOCK_KV, BLOCK_D] (float32) into its slot of the cache; an int8
    cache's scales [slots, kv_heads, GROUPS] beside it (BLOCK_G: GROUPS padded to BLOCK_D's)."""
    at = (slot * NUM_KV_HEADS + kv_heads[:, None]) * HEAD_DIM + dims[None, :]
    if QUANTIZED:
        values, scale = _quantized(x, BLOCK_G)
        tl.store(cache_ptr + at, values, mask=ok)
        groups = tl.arange(0, BLOCK_G)
        scale_at = (slot * NUM_KV_HEADS + kv_heads[:, None]) * GROUPS + groups[None, :]
        scale_ok = (kv_heads[:, None] < NUM_KV_HEADS) & (groups[None, :] < GROUPS)
        tl.store(scale_ptr + scale_at, scale, mask=scale_ok)
    else:
        tl.store(cache_ptr + at, x.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kv_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
    v_scale_ptr, qkv_row_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, QUANTIZED: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    rotary = dims < ROTARY
    cos = tl.load(cos_ptr + token * ROTARY + dims, mask=rotary, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * ROTARY + dims, mask=rotary, other=0.0).to(tl.float32)
    row_ptr = qkv_ptr + token * qkv_row_stride

    heads = tl.arange(0, BLOCK_H)
    q, q_ok = _rotated(row_ptr, heads, heads < NUM_HEADS, dims, cos, sin, HEAD_DIM, ROTARY)
    q_at = q_out_ptr + (token * NUM_HEADS + heads[:, None]) * HEAD_DIM + dims[None, :]
    tl.store(q_at, q.to(q_out_ptr.dtype.element_ty), mask=q_ok)

    kv_heads = tl.arange(0, BLOCK_KV)
    kv_ok = kv_heads < NUM_KV_HEADS
    k_row = row_ptr + NUM_HEADS * HEAD_DIM
    k, k_ok = _rotated(k_row, kv_heads, kv_ok, dims, cos, sin, HEAD_DIM, ROTARY)
    if QUANTIZED:
        # the rotated k as the activations' dtype holds it, as the reference path quantizes it
        k = k.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    slot = tl.load(slots_ptr + token)
    _store_kv(k_cache_ptr, k_scale_ptr, k, slot, kv_heads, k_ok, dims, NUM_KV_HEADS, HEAD_DIM,
              GROUPS, BLOCK_G, QUANTIZED)  # fmt: skip
    v_row = row_ptr + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    v = tl.load(v_row + kv_heads[:, None] * HEAD_DIM + dims[None, :], mask=k_ok, other=0.0)
    _store_kv(v_cache_ptr, v_scale_ptr, v.to(tl.float32), slot, kv_heads, k_ok, dims,
              NUM_KV_HEADS, HEAD_DIM, GROUPS, BLOCK_G, QUANTIZED)  # fmt: skip


def rope_kv_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """From qkv [T, (heads + 2·kv_heads)·dim]: RoPE on q and k (cos, signed_sin [T, 1, rotary]
    as rope.RotaryTable.cos_sin gives them), k and v into the cache at ``slots`` (int64 [T]);
    returns q [T, heads, dim], rotated. An int8 cache (``k_scale``, ``v_scale``: float16
    [slots, kv_heads, groups], a scale per 32 values of a head) takes each head quantized as
    kv_cache.quantize_int8 does it."""
    tokens = qkv.shape[0]
    rotary = cos.shape[-1]
    quantized = k_cache.dtype == torch.int8
    if quantized:
        check_int8_scales(k_cache, k_scale, v_scale)
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    block_d = triton.next_power_of_2(head_dim)
    # an int8 store unfused (no multiply-adds): its rounding decisions are then torch's
    options = {"enable_fp_fusion": False} if quantized else {}
    _rope_kv_store_kernel[(tokens,)](
        qkv, cos.reshape(tokens, rotary).contiguous(),
        signed_sin.reshape(tokens, rotary).contiguous(), slots, q, k_cache, v_cache,
        k_scale if quantized else k_cache, v_scale if quantized else v_cache,
        qkv.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        ROTARY=rotary, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_d,
        GROUPS=kv_int8_groups(head_dim), BLOCK_G=int8_block_groups(block_d), QUANTIZED=quantized,
        **options,
    )  # fmt: skip
    return q
