"""Linear layers whose weights can be prepacked for oneDNN's CPU GEMM.

``F.linear`` on a CPU re-lays the weight out into oneDNN's blocked format on every call (or runs
a plain BLAS); doing that once at load time (the op torch.compile's CPU backend uses for the same
purpose) made the SmolLM2 layer matmuls faster in bf16 at every batch measured, most at batch 1
(benchmarks/RESULTS.md). Only half-precision weights are packed: in fp32 the packed kernel sums in
another order, which moved SmolLM2's logprobs up to 8e-5 from transformers' (1e-4 is the bar the
float32 tests hold), and fp32 is the path kept exact. The ops are torch internals, so packing is
probed once per dtype and falls back to ``F.linear`` if they are missing or disagree.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x Wᵀ + b with W stored [out, in] as in checkpoints (the loader fills ``weight``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        weight: nn.Parameter | None = None,  # share a matrix (tied embeddings)
    ):
        super().__init__()
        if weight is None:
            weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=dtype, device=device),
                requires_grad=False,
            )
        self.weight: nn.Parameter | None = weight
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.out_features = out_features
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self, *, keep_weight: bool = False) -> bool:
        """Prepacks the weight for oneDNN if that works for its dtype; frees the plain copy
        unless ``keep_weight`` (a matrix shared with an embedding). Returns whether it packed."""
        weight = self.weight
        if weight is None or weight.device.type != "cpu" or not packing_works(weight.dtype):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        if not keep_weight:
            self.weight = None
        return True


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN linear runs here for ``dtype`` and agrees with F.linear."""
    if dtype == torch.float32:
        return False
    try:
        if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
            return False
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=gen).to(dtype)
        bias = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        want = F.linear(x, weight, bias)
        return bool(torch.allclose(got.float(), want.float(), rtol=5e-2, atol=5e-2))
    except (RuntimeError, AttributeError, TypeError):  # op missing, or no kernel for this CPU
        return False
