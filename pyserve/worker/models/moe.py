"""The gated MLP and the mixture of experts (a router choosing k gated MLPs per token).

An expert is a gated MLP like a dense layer's (fused gate/up, then down): its projections are
the backend's linear layers, so a quantized checkpoint's experts run on the same kernels as
the dense projections, each at its file's precision. The backend routes the tokens
(``Backend.route_experts``: ``route`` in torch, or the CPU kernels' own router, which the CPU
decoder stack shares). The step's tokens are grouped by expert
(one stable sort of the routing choices), and each expert picked by at least one token runs
once over its group (``Backend.run_experts``: a loop in torch, or the CPU kernels' grouped
matmuls), so a decode token reads only its k experts' weights. Experts that no token picked are not
touched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.worker.backends.base import Backend
from pyserve.worker.linear import Linear
from pyserve.worker.models.config import MoEConfig


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)), gate and up fused into one projection."""

    def __init__(
        self,
        hidden: int,
        width: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        bias: bool = False,
    ):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * width, bias=bias, dtype=dtype, device=device)
        self.down_proj = Linear(width, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, backend: Backend, activation: str) -> torch.Tensor:
        return self.down_proj(backend.gated_activation(self.gate_up_proj(x), activation))


class SparseMoE(nn.Module):
    """Routes each token to ``top_k`` experts and sums their outputs weighted by the router's
    probabilities (softmax over every expert's logit in float32, or over the k largest logits
    alone: gpt-oss), plus the shared expert scaled by its sigmoid gate where the model has
    one."""

    def __init__(
        self, hidden: int, moe: MoEConfig, *, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.config = moe  # what a backend's own router checks it computes (backends/cpu)
        self.top_k = moe.top_k
        self.normalize = moe.normalize_top_k
        self.softmax_after_top_k = moe.softmax_after_top_k
        self.router = nn.Parameter(
            torch.empty(moe.num_experts, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.router_bias = (
            nn.Parameter(torch.empty(moe.num_experts, dtype=dtype, device=device), False)
            if moe.router_bias
            else None
        )
        kw = {"dtype": dtype, "device": device}
        self.experts = nn.ModuleList(
            GatedMLP(hidden, moe.expert_size, bias=moe.expert_bias, **kw)
            for _ in range(moe.num_experts)
        )
        self.shared_expert = (
            GatedMLP(hidden, moe.shared_expert_size, **kw) if moe.shared_expert_size else None
        )
        self.shared_gate = (
            nn.Parameter(torch.empty(1, hidden, dtype=dtype, device=device), requires_grad=False)
            if moe.shared_expert_size
            else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of every token."""
        bias = None if self.router_bias is None else self.router_bias.float()
        logits = F.linear(x.float(), self.router.float(), bias)
        if self.softmax_after_top_k:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), experts
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def shared_expert_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """sigmoid(x · shared_gate) [T, 1], the shared expert's scale; None without one."""
        if self.shared_gate is None:
            return None
        return torch.sigmoid(F.linear(x, self.shared_gate))

    def forward(self, x: torch.Tensor, backend: Backend, activation: str) -> torch.Tensor:
        weights, experts, gate = backend.route_experts(self, x)
        out = backend.run_experts(self, x, weights, experts, activation)
        if self.shared_expert is not None:
            assert gate is not None
            out += self.shared_expert(x, backend, activation) * gate
        return out
