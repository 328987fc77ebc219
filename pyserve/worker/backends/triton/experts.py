"""A mixture's experts as one grouped matmul a projection, for the Triton backend.

Each projection's expert weights are stacked into one [E, N, K] tensor, float or 8-/4-bit as
quant_matmul.py packs a layer (the expert modules keep views into it, so the weights are not held
twice). A step's routing choices are grouped by expert with torch ops on the device (a stable
argsort and a count, no copy to the host, so a captured graph can hold them), and the grouped
rows are cut into tiles of ``BLOCK_M`` rows that never cross an expert: ``block_expert`` names
each tile's expert (-1 past the last tile: the grid is sized by an upper bound on the tile count,
known without reading the counts back) and ``block_row`` its first grouped row. One launch a
projection then covers every (tile, column block); a program reads its expert, multiplies its
rows with that expert's slice of the stack, and stops at the expert's last row (``row_ends``).
The gate/up launch reads its rows straight from the step's tokens (``row_token``), so the tokens
are never copied per choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import nn

from pyserve.worker.backends.triton import dot_precision
from pyserve.worker.backends.triton.quant_matmul import (
    DEFAULT_STEP_INPUTS,
    STEP_INPUTS,
    TritonQuantLinear,
    quant_tile_dot,
)
from pyserve.worker.linear import Linear

if TYPE_CHECKING:
    from pyserve.worker.backends.base import Backend
    from pyserve.worker.models.moe import SparseMoE


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, d_ptr, m_ptr, out_ptr, row_token_ptr, block_expert_ptr, block_row_ptr,
    row_ends_ptr, n, k, x_stride, w_expert_stride, w_stride, d_expert_stride, d_stride, groups,
    out_stride,
    GATHER: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last tile: the grid is an upper bound
        return
    first = tl.load(block_row_ptr + pid_m)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(row_ends_ptr + expert)
    if GATHER:  # gate/up: each grouped row is its token's row of x
        x_rows = tl.load(row_token_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        x_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    x_at = x_ptr + x_rows[:, None] * x_stride
    w_expert = w_ptr + expert.to(tl.int64) * w_expert_stride
    if BITS == 0:  # float weights [E, N, K]
        w_at = w_expert + cols.to(tl.int64)[None, :] * w_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            x = tl.load(x_at + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_at + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(x, w, input_precision=PRECISION)
    else:  # 8 or 4 bits, as quant_matmul.py lays them out: u [E, bytes, N], d and m [E, G, N]
        scales = expert.to(tl.int64) * d_expert_stride + cols[None, :]
        acc = quant_tile_dot(
            x_at, row_ok, w_expert + cols[None, :], w_stride, d_ptr + scales, m_ptr + scales,
            d_stride, col_ok, k, groups * GROUP, 0, groups * GROUP, x_ptr.dtype.element_ty, BITS,
            GROUP, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
        )  # fmt: skip
    out_at = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


BLOCK_N = 64


@dataclass
class ExpertStack:
    """One projection of every expert: float weights [E, N, K] (``bits`` 0), or 8-/4-bit ones
    as quant_matmul.py lays a layer out, stacked: u uint8 [E, bytes, N], d and m [E, groups, N];
    and the experts' biases [E, N] where they have them (gpt-oss)."""

    weight: torch.Tensor
    k: int
    bits: int = 0
    group: int = 0
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def n(self) -> int:
        """Outputs of each expert."""
        return self.weight.shape[2] if self.bits else self.weight.shape[1]

    @staticmethod
    def fits(layers: list[nn.Module]) -> bool:
        """Whether the layers stack: all layers of one kind, shape and format, plain float
        Linears (not prepacked for oneDNN: no plain weight left) or TritonQuantLinears, every
        one with a bias or none."""
        if all(type(layer) is Linear for layer in layers):
            if any(layer.weight is None or layer.packed is not None for layer in layers):
                return False
            formats = {(layer.weight.shape, layer.weight.dtype) for layer in layers}
        elif all(type(layer) is TritonQuantLinear for layer in layers):
            formats = {
                (layer.qweight.shape, layer.d.shape, layer.bits, layer.group) for layer in layers
            }
        else:
            return False
        return len(formats) == 1 and len({layer.bias is None for layer in layers}) == 1

    @classmethod
    def of(cls, layers: list[nn.Module]) -> ExpertStack:
        """Layers that fit, stacked; each is left holding views into the stack, so the weights
        are not held twice."""
        first = layers[0]
        bias = None if first.bias is None else _stacked(layers, "bias")
        if isinstance(first, Linear):
            stack = _stacked(layers, "weight")
            return cls(stack, k=stack.shape[2], bias=bias)
        return cls(
            _stacked(layers, "qweight"),
            k=first.in_features,
            bits=first.bits,
            group=first.group,
            d=_stacked(layers, "d"),
            m=_stacked(layers, "m"),
            bias=bias,
        )


@dataclass
class ExpertGroups:
    """A step's routing choices grouped by expert, and the row tiles of the grouped rows."""

    order: torch.Tensor  # int64 [R]: the flat routing choice of each grouped row
    row_token: torch.Tensor  # int64 [R]: the token of each grouped row
    row_expert: torch.Tensor  # int64 [R]: the expert of each grouped row
    block_expert: torch.Tensor  # int32 [tiles bound]: each tile's expert, -1 past the last
    block_row: torch.Tensor  # int32 [tiles bound]: each tile's first grouped row
    row_ends: torch.Tensor  # int32 [E]: one past each expert's last grouped row
    block_m: int


def group_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    """The routing choices ``experts`` [T, k] grouped by expert (stably: within an expert in
    token order, as the base backend's loop groups them), in tiles of ``block_m`` rows."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # not bincount: on CUDA it reads the largest id back to the host, which a graph cannot hold
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    # each active expert adds at most one partial tile
    bound = triton.cdiv(flat.numel(), block_m) + min(num_experts, flat.numel())
    tile = torch.arange(bound, device=flat.device)
    expert = torch.searchsorted(tile_ends, tile, right=True)
    inside = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    row = ends[e] - counts[e] + (tile - (tile_ends[e] - tiles[e])) * block_m
    return ExpertGroups(
        order=order,
        row_token=order // experts.shape[1],
        row_expert=flat.index_select(0, order),
        block_expert=torch.where(inside, expert, -1).to(torch.int32),
        block_row=torch.where(inside, row, 0).to(torch.int32),
        row_ends=ends.to(torch.int32),
        block_m=block_m,
    )


def grouped_matmul(
    x: torch.Tensor, stack: ExpertStack, groups: ExpertGroups, *, gather: bool
) -> torch.Tensor:
    """Each grouped row times its expert's weight (plus its bias): [R, N] in x's dtype.
    ``gather``: x holds the tokens [T, K] (a grouped row reads its token's row), else the
    grouped rows [R, K]."""
    rows = groups.order.numel()
    weight, n = stack.weight, stack.n
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    step = STEP_INPUTS.get(x.dtype, DEFAULT_STEP_INPUTS)
    # quantized: whole groups a step, on 8 warps as quant_matmul's tiles
    block_k = max(1, step // stack.group) * stack.group if stack.bits else step
    warps = 8 if stack.bits or groups.block_m >= 64 else 4
    d = stack.d if stack.d is not None else weight
    m = stack.m if stack.m is not None else weight
    grid = (groups.block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_matmul_kernel[grid](
        x, weight, d, m, out, groups.row_token, groups.block_expert, groups.block_row,
        groups.row_ends, n, stack.k, x.stride(0), weight.stride(0), weight.stride(1),
        d.stride(0), d.stride(1), d.shape[1] if stack.bits else 0, out.stride(0),
        GATHER=gather, BITS=stack.bits, GROUP=stack.group, BLOCK_M=groups.block_m,
        BLOCK_N=BLOCK_N, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype), num_warps=warps,
    )  # fmt: skip
    if stack.bias is not None:
        out += stack.bias.index_select(0, groups.row_expert)
    return out


def tile_rows(rows: int, num_experts: int, dtype: torch.dtype) -> int:
    """Rows a tile: 16 where few rows fall to each expert (and in float32, whose tiles take
    twice the registers), 64 for long prefills (on 8 warps: on 4 they spill registers at sm_90,
    tests/test_triton_compile.py)."""
    return 16 if dtype == torch.float32 or rows <= 16 * num_experts else 64


class TritonExperts:
    """The gate/up and down projections of every expert of one SparseMoE, each one stack."""

    def __init__(self, gate_up: ExpertStack, down: ExpertStack) -> None:
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up.weight.shape[0]

    @classmethod
    def of(cls, moe: SparseMoE) -> TritonExperts | None:
        """None unless each projection's experts are layers of one kind and format (biases on all
        or none):
        plain float Linears (not prepacked) or TritonQuantLinears; else the stacks."""
        gate_up = [expert.gate_up_proj for expert in moe.experts]
        down = [expert.down_proj for expert in moe.experts]
        if not (ExpertStack.fits(gate_up) and ExpertStack.fits(down)):
            return None
        return cls(ExpertStack.of(gate_up), ExpertStack.of(down))

    def run(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        activation: str,
        backend: Backend,
    ) -> torch.Tensor:
        """Backend.run_experts in two grouped launches: the tokens' rows through their experts'
        gate/up, the activation, down, and each token's rows summed back by weight in expert
        order (as the base backend's loop sums them)."""
        block_m = tile_rows(experts.numel(), self.num_experts, x.dtype)
        groups = group_by_expert(experts, self.num_experts, block_m)
        gate_up = grouped_matmul(x, self.gate_up, groups, gather=True)
        h = backend.gated_activation(gate_up, activation)
        y = grouped_matmul(h, self.down, groups, gather=False)
        y = y * weights.reshape(-1)[groups.order, None]
        return torch.zeros_like(x).index_add_(0, groups.row_token, y)


def _stacked(layers: list[nn.Module], name: str) -> torch.Tensor:
    """The layers' tensor ``name`` stacked; each layer's becomes a view into the stack, so the
    separate copies are freed."""
    stack = torch.stack([getattr(layer, name).detach() for layer in layers])
    for i, layer in enumerate(layers):
        view = stack[i]
        if isinstance(getattr(layer, name), nn.Parameter):
            view = nn.Parameter(view, requires_grad=False)
        setattr(layer, name, view)
    return stack
