"""Weight-only 8- and 4-bit linear layers in Triton: the quantized GGUF formats on the GPU.

The weights are the CPU kernels' (pyserve/worker/quant.py: w = d·u + m per group of inputs, d
and m fp16, u 8 or 4 bits), laid out for the GPU with the outputs contiguous: u as uint8 [k, n]
(8-bit) or two inputs to a byte [k/2, n] (4-bit: input 2j in the low nibble of byte row j, 2j+1
in the high one), d and m as fp16 [groups, n]. A warp then reads consecutive bytes of a row of
u and consecutive scales of a group, in the one layout ``tl.dot`` takes its right operand in
(the [n, k] order of the file had each thread load single bytes and scales a row apart). A
program computes a [BLOCK_M, BLOCK_N] tile of x·Wᵀ over a range of groups: each loop step
dequantizes [BLOCK_K, BLOCK_N] weights (whole groups) to the activations' dtype (in float32 from
the integers and scales) and multiplies them with ``tl.dot``, accumulating in float32. For the
few rows of a decode step the output tiles are too few to keep a GPU's streaming units busy, so
the steps are split between programs (split-K) whose float32 partial sums are added after.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import nn

from pyserve.worker.backends.triton import dot_precision
from pyserve.worker.quant import PackedWeight, dequantize_weight, unpack_weight
from pyserve.worker.weight_packing import QuantizedLayers


@triton.jit
def _dequantized(
    u, d_rows, m_rows, ok, dtype: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Weights [GROUPS·GROUP, BLOCK_N] of the activations' dtype from the integers u of whole
    groups and the groups' scales (pointers d_rows, m_rows [GROUPS, BLOCK_N]: each scale is
    read once and broadcast over its group's inputs in registers)."""
    d = tl.load(d_rows, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(m_rows, mask=ok, other=0.0).to(tl.float32)
    u = tl.reshape(u.to(tl.float32), [GROUPS, GROUP, BLOCK_N])
    w = u * d[:, None, :] + m[:, None, :]
    return tl.reshape(w, [GROUPS * GROUP, BLOCK_N]).to(dtype)


@triton.jit
def quant_tile_dot(
    x_rows, row_ok, w_cols, w_row_stride, d_cols, m_cols, scale_row_stride, col_ok, k, k_pad,
    first, last, dtype: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The float32 [BLOCK_M, BLOCK_N] tile of x·Wᵀ over inputs first..last: x_rows the rows'
    pointers [BLOCK_M, 1]; w_cols, d_cols and m_cols the columns' first row of packed weights
    and of scales [1, BLOCK_N], whose next rows are w_row_stride and scale_row_stride on."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    for k0 in range(first, last, BLOCK_K):
        groups = k0 // GROUP + tl.arange(0, GROUPS)
        scales_ok = (groups < k_pad // GROUP)[:, None] & col_ok[None, :]
        at = groups.to(tl.int64)[:, None] * scale_row_stride
        if BITS == 8:
            ks = k0 + tl.arange(0, BLOCK_K)
            ok = (ks < k_pad)[:, None] & col_ok[None, :]
            u = tl.load(w_cols + ks.to(tl.int64)[:, None] * w_row_stride, mask=ok, other=0)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < k)[None, :], other=0.0)
            w = _dequantized(u, d_cols + at, m_cols + at, scales_ok, dtype, GROUPS, GROUP, BLOCK_N)
            acc += tl.dot(x, w, input_precision=PRECISION)
        else:
            # byte row j holds inputs 2j (low nibble) and 2j+1 (high): a group's bytes are
            # GROUP/2 rows, so the low and the high nibbles each make whole half groups
            half = tl.arange(0, BLOCK_K // 2)
            ok = (k0 + 2 * half < k_pad)[:, None] & col_ok[None, :]
            byte_rows = (k0 // 2 + half).to(tl.int64)[:, None] * w_row_stride
            both = tl.load(w_cols + byte_rows, mask=ok, other=0)
            ks = k0 + tl.arange(0, BLOCK_K)  # read whole (contiguous), then split in two
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < k)[None, :], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
            d_at, m_at = d_cols + at, m_cols + at
            HALF: tl.constexpr = GROUP // 2
            low = _dequantized(both & 0x0F, d_at, m_at, scales_ok, dtype, GROUPS, HALF, BLOCK_N)
            high = _dequantized(both >> 4, d_at, m_at, scales_ok, dtype, GROUPS, HALF, BLOCK_N)
            acc += tl.dot(x_even, low, input_precision=PRECISION)
            acc += tl.dot(x_odd, high, input_precision=PRECISION)
    return acc


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, d_ptr, m_ptr, bias_ptr, out_ptr, rows, n, k, x_stride, out_stride,
    w_stride, scale_stride, groups, groups_per_split,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    m_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m_rows < rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + m_rows.to(tl.int64)[:, None] * x_stride
    k_pad = groups * GROUP
    # BLOCK_K inputs (whole groups) a step; a split's groups are whole steps
    first = split * groups_per_split * GROUP
    last = tl.minimum(first + groups_per_split * GROUP, k_pad)
    acc = quant_tile_dot(
        x_rows, row_ok, w_ptr + cols[None, :], w_stride, d_ptr + cols[None, :],
        m_ptr + cols[None, :], scale_stride, col_ok, k, k_pad, first, last, dtype,
        BITS, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
    )  # fmt: skip
    out_at = out_ptr + split * rows * out_stride + m_rows[:, None] * out_stride + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:  # float32 partial sums; the wrapper adds them and the bias
        tl.store(out_at, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=ok)


# inputs a loop step reads (whole groups): two groups in 16-bit dtypes, one in float32; more
# spill registers at sm_90 (tests/test_triton_compile.py)
STEP_INPUTS = {torch.float32: 32}
DEFAULT_STEP_INPUTS = 64


def _programs_wanted(device: torch.device) -> int:
    """Programs that keep a GPU's streaming multiprocessors busy (a few each); 1 elsewhere (the
    interpreter runs programs one after another)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return 4 * _multiprocessors(index)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def quant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    *,
    bits: int,
    group: int,
    n: int,
    bias: torch.Tensor | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x [rows, k] @ Wᵀ (+ bias) in x's dtype, W = d·u + m packed as the module docstring says
    (``weight`` uint8 [k_pad·bits/8, n], d and m fp16 [groups, n]). ``split``: the groups in
    this many parts (None: what keeps the GPU busy)."""
    rows, k = x.shape
    groups = d.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    # 8 warps and, in float32, 16 rows a tile: no register spills at sm_90 (test_triton_compile)
    block_m = 16 if rows <= 16 or x.dtype == torch.float32 else 32 if rows <= 32 else 64
    block_n = 64
    step_groups = max(1, STEP_INPUTS.get(x.dtype, DEFAULT_STEP_INPUTS) // group)
    steps = triton.cdiv(groups, step_groups)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    if split is None:
        split = _programs_wanted(x.device) // tiles
    split = max(1, min(steps, split))
    per_split = triton.cdiv(steps, split) * step_groups  # whole steps
    split = triton.cdiv(groups, per_split)  # no split left without groups
    if split > 1:
        out = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n), split)
    _quant_matmul_kernel[grid](
        x, weight, d, m, bias if bias is not None else d, out, rows, n, k, x.stride(0), n,
        weight.stride(0), d.stride(0), groups, per_split,
        BITS=bits, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=step_groups * group, HAS_BIAS=bias is not None, SPLIT=split > 1,
        PRECISION=dot_precision(x.dtype), num_warps=8,
    )  # fmt: skip
    if split == 1:
        return out
    total = out.sum(0)
    if bias is not None:
        total += bias.float()
    return total.to(x.dtype)


def device_layout(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, d, m) of a packed weight in this module's layout, on the CPU: u uint8 [k_pad, n]
    (8-bit) or [k_pad/2, n] (4-bit), d and m fp16 [groups, n]."""
    if packed.mxfp4:  # its u (value + 12) would not fit the nibbles, its d and m not fp16
        raise ValueError(
            "MXFP4's own form runs on the CPU kernels; the Triton layers take it in 8-bit tiles "
            "(weight_packing.Packing with own_widths=False)"
        )
    u, d, m = unpack_weight(packed)
    u, d, m = u[: packed.n], d[: packed.n], m[: packed.n]
    if packed.bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    return u.t().contiguous(), d.t().contiguous(), m.t().contiguous()


class TritonQuantLinear(nn.Module):
    """A linear layer with 8- or 4-bit weights on the Triton kernel, for the Triton backend."""

    def __init__(
        self,
        packed: PackedWeight,
        bias: torch.Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = packed.k, packed.n
        self.bits, self.group = packed.bits, packed.group
        u, d, m = device_layout(packed)
        self.register_buffer("qweight", u.to(device))
        self.register_buffer("d", d.to(device))
        self.register_buffer("m", m.to(device))
        self.bias = None
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0:  # a step whose rows all belong to unfinished prefill chunks samples none
            return x.new_empty(*x.shape[:-1], self.out_features)
        out = quant_matmul(
            x.reshape(rows, self.in_features),
            self.qweight,
            self.d,
            self.m,
            bits=self.bits,
            group=self.group,
            n=self.out_features,
            bias=self.bias,
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group={self.group}"
        )


def triton_quantized_layers(device: torch.device | str) -> QuantizedLayers:
    """The Triton backend's quantized layers on ``device`` (Backend.quantized_layers)."""

    def linear(weight: PackedWeight, bias: torch.Tensor | None, *, dtype, activation_bits):
        # activation_bits: the kernel multiplies the activations as they are
        return TritonQuantLinear(weight, bias, dtype=dtype, device=device)

    def embedding(table: PackedWeight, *, dtype: torch.dtype) -> nn.Parameter:
        # a plain table on the device: lookups stay one gather
        values = dequantize_weight(table).to(dtype).to(device)
        return nn.Parameter(values, requires_grad=False)

    return QuantizedLayers(own_widths=False, linear=linear, embedding=embedding)
