"""A mixture's router and experts on the kernels.

The router (``KernelRouter``, ``_kernels.moe_route``) computes SparseMoE.route and the shared
expert's gate in C++ for the layer loop and the decoder stack alike: torch's float32 matmul,
softmax and sigmoid round in orders of their own, which no other code reproduces, so both paths
take the kernel's and route every token the same way to the bit (within float32 rounding of
torch's, and with torch.topk's order among equal probabilities).

The experts: one grouped matmul a projection for all of a step's
experts (``_kernels.ExpertSet``, cpp/kernels/dispatch.cpp's grouped_matmul), so that the
thread pool runs every active expert's token group side by side instead of two kernel calls
and a gather an expert, one expert after another. Each row is computed as the expert's own
QuantLinear computes it, bit for bit.

Each projection's experts are moved into one buffer on huge pages (a GGUF's experts are packed
one by one, each in a buffer smaller than a huge page): a step reads a few experts scattered
over the layer's, and on 4 KiB pages each expert's first bytes cost TLB misses the hardware
prefetcher does not cross."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING

import torch

from pyserve.worker import quant
from pyserve.worker.backends.cpu.quant_linear import QuantLinear

ALIGN = 64  # bytes: each expert's packed weights start on a cache line

if TYPE_CHECKING:
    from pyserve.worker.backends.base import Backend
    from pyserve.worker.models.moe import SparseMoE


class ExpertKernels:
    """The gate/up and down projections of every expert of one SparseMoE, as two ExpertSets."""

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear]) -> None:
        self.layers = (gate_up, down)  # keeps the packed weights the sets point into alive
        self.activation_bits = gate_up[0].activation_bits
        self.hidden, self.width = gate_up[0].in_features, down[0].in_features
        self.gate_up, self.down = _expert_set(gate_up), _expert_set(down)
        # float32 [E, N] each, where the experts have biases (gpt-oss): added to each grouped
        # row after its matmul, as the expert's own QuantLinear adds it
        self.gate_up_bias, self.down_bias = _stacked_bias(gate_up), _stacked_bias(down)

    @classmethod
    def build(cls, moe: SparseMoE) -> ExpertKernels | None:
        """The kernels of ``moe``, its experts' weights moved into one buffer a projection;
        None (and nothing moved) where a projection is not one packed weight on the kernels at
        every row count (float experts, segments of mixed types, a bf16 model's float fallback),
        or only some experts have biases."""
        gate_up = [expert.gate_up_proj for expert in moe.experts]
        down = [expert.down_proj for expert in moe.experts]
        layers = gate_up + down
        if not all(isinstance(layer, QuantLinear) for layer in layers):
            return None
        if any(
            not isinstance(layer.weight_args, tuple) or layer.max_kernel_rows is not None
            for layer in layers
        ):
            return None
        if len({layer.bias is None for layer in layers}) != 1:
            return None
        if len({layer.activation_bits for layer in layers}) != 1:
            return None
        del gate_up, down, layers
        _move_into_one_buffer(moe)
        quant.return_freed_memory()  # the experts' old buffers, freed into malloc's heap
        gate_up = [expert.gate_up_proj for expert in moe.experts]
        down = [expert.down_proj for expert in moe.experts]
        return cls(gate_up, down)  # type: ignore[arg-type]

    def run(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        activation: str,
        backend: Backend,
    ) -> torch.Tensor:
        """Backend.run_experts on the kernels: the routing choices grouped by expert
        (``moe_group``), the grouped rows through every active expert's gate/up, activation and
        down, each token's rows summed back by weight (``moe_combine``)."""
        kernels = quant.kernels()
        tokens, top_k = experts.shape
        rows = tokens * top_k
        experts = experts.contiguous()
        weights = weights.float().contiguous()
        row_token = torch.empty(rows, dtype=torch.int64)
        row_weight = torch.empty(rows)
        counts = torch.empty(len(self.layers[0]), dtype=torch.int64)
        kernels.moe_group(
            experts.data_ptr(), weights.data_ptr(), tokens, top_k, counts.numel(),
            row_token.data_ptr(), row_weight.data_ptr(), counts.data_ptr(),
        )  # fmt: skip
        grouped = x.float().index_select(0, row_token)
        bits = self.activation_bits
        row_expert = None
        if self.gate_up_bias is not None:
            row_expert = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        gate_up = torch.empty(rows, 2 * self.width)
        self.gate_up.matmul(
            grouped.data_ptr(), self.hidden, bits, counts.data_ptr(), gate_up.data_ptr(),
            2 * self.width,
        )  # fmt: skip
        if self.gate_up_bias is not None:
            gate_up += self.gate_up_bias.index_select(0, row_expert)
        h = backend.gated_activation(gate_up, activation).float().contiguous()
        y = torch.empty(rows, self.hidden)
        self.down.matmul(
            h.data_ptr(), self.width, bits, counts.data_ptr(), y.data_ptr(), self.hidden
        )
        if self.down_bias is not None:
            y += self.down_bias.index_select(0, row_expert)
        out = torch.empty(tokens, self.hidden)
        kernels.moe_combine(
            y.data_ptr(), self.hidden, row_token.data_ptr(), row_weight.data_ptr(), rows,
            self.hidden, out.data_ptr(), self.hidden, tokens,
        )  # fmt: skip
        return out if x.dtype == torch.float32 else out.to(x.dtype)


# The MoEConfig fields the kernels compute (moe_route: the router, its bias and gpt-oss's softmax
# after the top k; ExpertKernels and the stack: the experts' biases); another field set away from
# its default (a routing feature added later) leaves the mixture to torch's route, which knows it.
ROUTE_FIELDS = frozenset(
    {
        "num_experts",
        "top_k",
        "expert_size",
        "normalize_top_k",
        "shared_expert_size",
        "router_bias",
        "expert_bias",
        "softmax_after_top_k",
    }
)


class KernelRouter:
    """SparseMoE.route and SparseMoE.shared_expert_gate of one mixture on the kernels, for
    float32 tokens."""

    def __init__(self, moe: SparseMoE) -> None:
        self.router = moe.router  # float32 [experts, hidden], contiguous (checked by build)
        self.shared_gate = moe.shared_gate  # float32 [1, hidden] or None
        self.bias = moe.router_bias  # float32 [experts] or None
        self.top_k, self.normalize = moe.top_k, moe.normalize
        self.softmax_after_top_k = moe.softmax_after_top_k

    @staticmethod
    def unsupported(moe: SparseMoE) -> str | None:
        """Why the kernel cannot route ``moe`` as SparseMoE does, or None."""
        config = moe.config
        for f in fields(config):
            if f.name not in ROUTE_FIELDS and getattr(config, f.name) != f.default:
                return f"the router's {f.name}"
        experts, hidden = moe.router.shape
        gates = [moe.router] + ([] if moe.shared_gate is None else [moe.shared_gate])
        if moe.router_bias is not None:
            gates.append(moe.router_bias)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in gates):
            return f"a {moe.router.dtype} router"
        if moe.shared_gate is not None and moe.shared_gate.shape != (1, hidden):
            return "a shared gate unlike [1, hidden]"
        if moe.router_bias is not None and moe.router_bias.shape != (experts,):
            return "a router bias unlike [experts]"
        return None

    @classmethod
    def build(cls, moe: SparseMoE) -> KernelRouter | None:
        return None if cls.unsupported(moe) else cls(moe)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Backend.route_experts for float32 tokens x [T, hidden]."""
        experts_count, hidden = self.router.shape
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != hidden:
            raise ValueError(f"moe_route takes float32 [T, {hidden}], not {x.dtype} {x.shape}")
        if x.stride(1) != 1:
            x = x.contiguous()
        tokens = x.shape[0]
        weights = torch.empty(tokens, self.top_k)
        experts = torch.empty(tokens, self.top_k, dtype=torch.int64)
        gate = None if self.shared_gate is None else torch.empty(tokens, 1)
        quant.kernels().moe_route(
            x.data_ptr(), max(x.stride(0), hidden), tokens, hidden, self.router.data_ptr(),
            experts_count, self.top_k, self.normalize, weights.data_ptr(), experts.data_ptr(),
            0 if gate is None else self.shared_gate.data_ptr(),
            0 if gate is None else gate.data_ptr(),
            0 if self.bias is None else self.bias.data_ptr(), self.softmax_after_top_k,
        )  # fmt: skip
        return weights, experts, gate


def _move_into_one_buffer(moe: SparseMoE) -> None:
    """Each projection's experts moved into one buffer (the old layers and their buffers are
    dropped)."""
    for name in ("gate_up_proj", "down_proj"):
        packed = _in_one_buffer([getattr(expert, name) for expert in moe.experts])
        for expert, layer in zip(moe.experts, packed, strict=True):
            setattr(expert, name, layer)


def _in_one_buffer(layers: list[QuantLinear]) -> list[QuantLinear]:
    """The same layers with their packed weights copied into one buffer (data) and another
    (scales), each on huge pages where Linux gives them (quant.weight_buffer)."""

    def moved(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [-(-t.nbytes // ALIGN) * ALIGN for t in tensors]
        buffer = quant.weight_buffer((sum(sizes),), torch.uint8)
        out, start = [], 0
        for t, size in zip(tensors, sizes, strict=True):
            view = buffer[start : start + t.nbytes].view(t.dtype).view(t.shape)
            out.append(view.copy_(t))
            start += size
        return out

    data = moved([layer.packed.data for layer in layers])
    scales = moved([layer.packed.scales for layer in layers])
    return [
        QuantLinear.from_packed(
            replace(layer.packed, data=d, scales=s),
            layer.bias,
            activation_bits=layer.activation_bits,
            max_kernel_rows=None,
        )
        for layer, d, s in zip(layers, data, scales, strict=True)
    ]


def _stacked_bias(layers: list[QuantLinear]) -> torch.Tensor | None:
    if layers[0].bias is None:
        return None
    return torch.stack([layer.bias.detach().float() for layer in layers])


def _expert_set(layers: list[QuantLinear]):
    experts = quant.kernels().ExpertSet()
    for layer in layers:
        data, scales, n, k, bits, group, _bias = layer.weight_args
        experts.add(data, scales, n, k, bits, group, layer.super_scales[0], layer.mxfp4[0])
    return experts
