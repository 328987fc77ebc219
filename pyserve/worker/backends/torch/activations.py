"""The gated activations in plain torch: the torch backend's, and what the other backends run
for an activation their kernels do not compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyserve.worker.models.config import ModelConfig


def gated_activation(gate_up: torch.Tensor, activation: str, config: ModelConfig) -> torch.Tensor:
    """act(gate) · up for gate_up = [..., 2·width] holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "clamped_swiglu":
        return clamped_swiglu(gate, up, config.swiglu_alpha, config.swiglu_limit)
    raise ValueError(f"activation {activation!r} is not supported")


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's gated activation, as transformers' GptOssExperts._apply_gate."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
