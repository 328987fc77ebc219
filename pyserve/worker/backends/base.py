"""The backend interface: how one worker computes the ops its model calls.

A backend is chosen once when the worker starts (``select_backend`` in this package). It owns the
KV cache's layout and allocation, the per-forward metadata (``prepare``: block tables → index
tensors, once per forward, shared by every layer; a CUDA backend keeps them in static buffers
that a captured graph replays), attention, and the fused ops: norms, gated activations, rope +
KV store. Models (pyserve/worker/models/) call only these ops, so a family runs on every
backend, and a backend runs every family: what its fast kernels cannot compute for a layer, it
computes with the reference ops, never differently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.models.config import ModelConfig

if TYPE_CHECKING:
    from pyserve.worker.models.decoder import CausalLM


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

    @classmethod
    def of(cls, config: ModelConfig, index: int) -> AttentionLayer:
        return cls(
            index=index,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.scale,
            sliding_window=config.layers[index].sliding_window,
            softcap=config.attn_softcap,
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

    name = "abstract"
    kv_cache_class: type[PagedKVCache] = PagedKVCache  # the layout its attention reads

    def __init__(self, config: ModelConfig, device: torch.device, reason: str) -> None:
        self.config = config
        self.device = device
        self.reason = reason
        self.kv_cache: PagedKVCache | None = None

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

    # ------------------------------------------------------------------ per forward

    def forward(self, model: CausalLM, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [S, vocab] of the batch's sampling rows (a backend may replay a
        captured graph instead)."""
        device = self.device
        return model(
            batch.input_ids.to(device),
            batch.positions.to(device),
            batch.sample_index.to(device),
            self,
            self.prepare(batch),
        )

    def forward_hidden(
        self, model: CausalLM, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits ``forward`` gives, float32 final-norm hidden states [H, hidden] of the
        rows in ``batch.hidden_index``), always through the model's own forward: a captured
        graph or whole-stack shortcut that ends in logits has no place for the hidden rows."""
        assert batch.hidden_index is not None
        device = self.device
        return model(
            batch.input_ids.to(device),
            batch.positions.to(device),
            batch.sample_index.to(device),
            self,
            self.prepare(batch),
            batch.hidden_index.to(device),
        )

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> object:
        """Index tensors for this batch, shared by every layer."""

    def run_layers(
        self,
        model: CausalLM,
        hidden: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer over the embeddings: (the last MLP output, the residual stream it
        adds to). A backend may run them all at once; this is the layer loop."""
        residual = None  # the residual stream, a fresh tensor each layer adds into in place
        for layer in model.layers:
            cos, sin = ropes[layer.rope_table]
            hidden, residual = layer(hidden, residual, cos, sin, self, metadata)
        assert residual is not None
        return hidden, residual

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
