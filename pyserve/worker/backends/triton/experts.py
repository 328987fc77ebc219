"""A mixture's experts as one grouped matmul a projection, for the Triton backend.

Each projection's expert weights are stacked into one [E, N, K] tensor (the expert modules keep
views into it, so the weights are not held twice). A step's routing choices are grouped by
expert with torch ops on the device (a stable argsort and a bincount, no copy to the host, so a
captured graph can hold them), and the grouped rows are cut into tiles of ``BLOCK_M`` rows that
never cross an expert: ``block_expert`` names each tile's expert (-1 past the last tile: the
grid is sized by an upper bound on the tile count, known without reading the counts back) and
``block_row`` its first grouped row. One launch a projection then covers every (tile, column
block); a program reads its expert, multiplies its rows with that expert's slice of the stack,
and stops at the expert's last row (``row_ends``). The gate/up launch reads its rows straight
from the step's tokens (``row_token``), so the tokens are never copied per choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import nn

from pyserve.worker.backends.triton import dot_precision
from pyserve.worker.linear import Linear

if TYPE_CHECKING:
    from pyserve.worker.backends.base import Backend
    from pyserve.worker.models.moe import SparseMoE


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, out_ptr, row_token_ptr, block_expert_ptr, block_row_ptr, row_ends_ptr,
    n, k, x_stride, w_expert_stride, w_stride, out_stride,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
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
    w_at = w_ptr + expert.to(tl.int64) * w_expert_stride + cols.to(tl.int64)[None, :] * w_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = tl.load(x_at + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_at + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(x, w, input_precision=PRECISION)
    out_at = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


BLOCK_N = 64
# inputs a loop step reads: fewer in float32, whose tiles take twice the registers
STEP_INPUTS = {torch.float32: 32}
DEFAULT_STEP_INPUTS = 64


@dataclass
class ExpertGroups:
    """A step's routing choices grouped by expert, and the row tiles of the grouped rows."""

    order: torch.Tensor  # int64 [R]: the flat routing choice of each grouped row
    row_token: torch.Tensor  # int64 [R]: the token of each grouped row
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
        block_expert=torch.where(inside, expert, -1).to(torch.int32),
        block_row=torch.where(inside, row, 0).to(torch.int32),
        row_ends=ends.to(torch.int32),
        block_m=block_m,
    )


def grouped_matmul(
    x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups, *, gather: bool
) -> torch.Tensor:
    """Each grouped row times its expert's weight: [R, N] in x's dtype, ``weight`` [E, N, K].
    ``gather``: x holds the tokens [T, K] (a grouped row reads its token's row), else the
    grouped rows [R, K] themselves."""
    rows = groups.order.numel()
    _, n, k = weight.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (groups.block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_matmul_kernel[grid](
        x, weight, out, groups.row_token, groups.block_expert, groups.block_row, groups.row_ends,
        n, k, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        GATHER=gather, BLOCK_M=groups.block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=STEP_INPUTS.get(x.dtype, DEFAULT_STEP_INPUTS),
        PRECISION=dot_precision(x.dtype), num_warps=8 if groups.block_m >= 64 else 4,
    )  # fmt: skip
    return out


def tile_rows(rows: int, num_experts: int, dtype: torch.dtype) -> int:
    """Rows a tile: 16 where few rows fall to each expert (and in float32, whose tiles take
    twice the registers), 64 for long prefills (on 8 warps: 4 spill registers at sm_90,
    tests/test_triton_compile.py)."""
    return 16 if dtype == torch.float32 or rows <= 16 * num_experts else 64


class TritonExperts:
    """The gate/up and down projections of every expert of one SparseMoE, each stacked [E, N, K]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up.shape[0]

    @classmethod
    def of(cls, moe: SparseMoE) -> TritonExperts | None:
        """None unless every expert projection is a plain float Linear (no bias, not prepacked)
        of one dtype; else the stacks, with each expert's weight a view into them."""
        layers = [e.gate_up_proj for e in moe.experts] + [e.down_proj for e in moe.experts]
        if not all(
            type(layer) is Linear
            and layer.weight is not None
            and layer.packed is None
            and layer.bias is None
            for layer in layers
        ):
            return None
        if len({(layer.weight.dtype, layer.weight.device) for layer in layers}) != 1:
            return None
        del layers
        return cls(_stacked(moe, "gate_up_proj"), _stacked(moe, "down_proj"))

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


def _stacked(moe: SparseMoE, name: str) -> torch.Tensor:
    """One projection's expert weights as [E, N, K]; each expert's weight becomes a view into
    it, so the separate copies are freed."""
    layers = [getattr(expert, name) for expert in moe.experts]
    stack = torch.stack([layer.weight.detach() for layer in layers])
    for i, layer in enumerate(layers):
        layer.weight = nn.Parameter(stack[i], requires_grad=False)
    return stack
