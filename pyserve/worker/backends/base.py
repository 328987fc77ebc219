"""The backend interface: how one worker computes the ops its model calls.

A backend is chosen once when the worker starts (``select_backend`` in this package). It owns the
KV cache's layout and allocation, the per-forward metadata (``prepare``: block tables → index
tensors, once per forward, shared by every layer; a CUDA backend keeps them in static buffers
that a captured graph replays), attention, the fused ops (norms, gated activations, rope + KV
store), the layers its packed weights run on (``quantized_layers``) and its fast path: a way to
run a whole step at once that the model runner asks for once per step (``fast_path``). Models
(pyserve/worker/models/) call only these ops, so a family runs on every backend, and a backend
runs every family: what its fast kernels cannot compute for a layer, it computes with the
reference ops (backends/torch/), never differently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.models.config import ModelConfig

if TYPE_CHECKING:
    from pyserve.worker.models.decoder import CausalLM
    from pyserve.worker.models.moe import SparseMoE
    from pyserve.worker.weight_packing import QuantizedLayers


class GroupedExperts(Protocol):
    """A backend's form of one mixture's experts that runs them all at once."""

    def run(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        activation: str,
        backend: Backend,
    ) -> torch.Tensor: ...


# what a forward returns: float32 logits [S, vocab] of the sampling rows, and with
# ``batch.hidden_index`` the float32 final-norm hidden states [H, hidden] of those rows too
ForwardOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttentionLayer:
    """What one layer's attention computes (read from the ModelConfig)."""

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # the last W positions, the query's own included
    softcap: float | None = None  # scores → cap·tanh(scores / cap) before the softmax
    # float32 [heads] logits that join each head's softmax as one more column with no value
    # (gpt-oss); the layer's parameter, filled in place by the loader
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, config: ModelConfig, index: int, sinks: torch.Tensor | None = None
    ) -> AttentionLayer:
        return cls(
            index=index,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.scale,
            sliding_window=config.layers[index].sliding_window,
            softcap=config.attn_softcap,
            sinks=sinks,
        )


@dataclass
class QKNorm:
    """Per-head RMSNorm weights of q and k ([head_dim] each), applied before RoPE."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


@dataclass
class BackendInfo:
    """What runs, for the startup log and /server_info."""

    name: str
    reason: str  # why this backend was chosen
    kernels: dict[str, str] = field(default_factory=dict)  # op → what computes it


class Backend(ABC):
    """One model's ops on one device; ``prepare_model`` is called once the weights are loaded."""

    name = "abstract"  # what --backend calls it (its entry in this package's REGISTRY)
    kv_cache_class: type[PagedKVCache] = PagedKVCache  # the layout its attention reads

    def __init__(self, config: ModelConfig, device: torch.device, reason: str) -> None:
        self.config = config
        self.device = device
        self.reason = reason
        self.kv_cache: PagedKVCache | None = None
        # a backend's grouped form of each mixture's experts (group_experts), by id() of the
        # model's SparseMoEs; run_experts loops over the experts of the others
        self.expert_kernels: dict[int, GroupedExperts] = {}

    # ------------------------------------------------------------------ selection

    @classmethod
    def auto_choice(cls, device: torch.device) -> tuple[bool, str] | None:
        """What ``--backend auto`` makes of this backend on ``device``: None where it is not the
        device's backend; (True, why) where it runs; (False, why not) where it is, but cannot
        run here (the torch reference runs instead, for that reason)."""
        return None

    @classmethod
    def asked_for(cls, device: torch.device) -> str:
        """The reason logged when ``--backend`` names this backend; raises ValueError where it
        cannot run on ``device``."""
        return f"asked for (--backend {cls.name})"

    # ------------------------------------------------------------------ set-up

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> PagedKVCache:
        cfg = self.config
        self.kv_cache = self.kv_cache_class(
            num_layers=cfg.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            device=self.device,
        )
        return self.kv_cache

    def prepare_model(self, model: CausalLM) -> None:  # noqa: B027 (optional hook)
        """After loading (and quantizing): build the fast paths that apply to this model."""

    @abstractmethod
    def info(self) -> BackendInfo: ...

    @abstractmethod
    def quantized_layers(self, quantization: str) -> QuantizedLayers:
        """What this backend runs packed weights on (the loader's factory of quantized layers);
        raises ValueError, naming ``quantization``, where nothing can run them here."""

    # ------------------------------------------------------------------ per forward

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> object:
        """Index tensors for this batch, shared by every layer."""

    def fast_path(self, model: CausalLM, batch: ForwardBatch) -> Callable[[], ForwardOutput] | None:
        """A way to compute ``batch`` other than the model's layer loop (a captured graph, every
        layer in one call), with the same outputs, or None: the runner asks once per step. A
        path that ends in logits has no place for hidden rows: None when the batch asks for
        them (``batch.hidden_index``)."""
        return None

    # ------------------------------------------------------------------ ops

    @abstractmethod
    def attention(
        self,
        layer: AttentionLayer,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: object,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """From a fused projection qkv [T, (heads + 2·kv_heads)·head_dim]: q/k norm if given,
        RoPE on q and k (cos, signed_sin: rope.RotaryTable.cos_sin's), the new tokens' k and v
        into the cache, then attention of every row over its request's cached positions and its
        own entry's rows up to itself. Returns [T, heads·head_dim]."""

    @abstractmethod
    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """weight · x / sqrt(mean(x²) + eps) over the last dim; with ``residual`` (updated in
        place), residual += x first and the sum is normalized."""

    @abstractmethod
    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) · up for gate_up = [..., 2·width] holding gate then up."""

    def group_experts(
        self, model: CausalLM, build: Callable[[SparseMoE], GroupedExperts | None]
    ) -> str | None:
        """Builds each mixture's grouped experts where ``build`` can (at prepare_model); says on
        how many layers, for info() (None: no mixture)."""
        moes = [layer.moe for layer in model.layers if layer.moe is not None]
        self.expert_kernels = {
            id(moe): kernels for moe in moes if (kernels := build(moe)) is not None
        }
        return f"grouped on {len(self.expert_kernels)} of {len(moes)} layers" if moes else None

    def route_experts(
        self, moe: SparseMoE, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The mixture's routing of tokens x [T, hidden]: (weights [T, k] in x's dtype, expert
        ids [T, k], the shared expert's gate [T, 1] or None), SparseMoE.route's and
        SparseMoE.shared_expert_gate's; a backend may compute the same on its kernels."""
        weights, experts = moe.route(x)
        return weights, experts, moe.shared_expert_gate(x)

    def run_experts(
        self,
        moe: SparseMoE,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """The mixture's output [T, hidden] for tokens x [T, hidden] routed to ``experts``
        [T, k] with ``weights`` [T, k]: each expert some token picked runs once over those
        tokens (the backend's grouped experts where group_experts built them, else a loop), and
        each token's outputs are
        summed by weight in expert order, as transformers sums them."""
        grouped = self.expert_kernels.get(id(moe))
        if grouped is not None:
            return grouped.run(x, weights, experts, activation, self)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the routing choices grouped by expert
        tokens = order // experts.shape[1]
        grouped = x.index_select(0, tokens)
        y = torch.empty_like(grouped)
        start = 0
        counts = torch.bincount(flat, minlength=len(moe.experts)).tolist()
        for expert, count in zip(moe.experts, counts, strict=True):
            if count:
                y[start : start + count] = expert(grouped[start : start + count], self, activation)
                start += count
        return torch.zeros_like(x).index_add_(0, tokens, y * weights.reshape(-1)[order, None])


def model_forward(model: CausalLM, backend: Backend, batch: ForwardBatch) -> ForwardOutput:
    """``batch`` through the model's own forward (its layer loop) on ``backend``."""
    device = backend.device
    hidden_index = None if batch.hidden_index is None else batch.hidden_index.to(device)
    return model(
        batch.input_ids.to(device),
        batch.positions.to(device),
        batch.sample_index.to(device),
        backend,
        backend.prepare(batch),
        hidden_index,
        batch.image_rows,
        batch.image_embeds,
        None if batch.rope_positions is None else batch.rope_positions.to(device),
    )
