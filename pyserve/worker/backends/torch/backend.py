"""The torch reference backend: every op in plain torch, on any device; the ground truth the fast
backends are tested against (its attention: attention.py, which the CPU kernels backend runs too
for the layers its kernels do not cover).

It has no quantized kernels of its own: packed weights run on the CPU kernels' layers on the CPU,
on the Triton kernels' elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyserve.worker.backends.base import Backend, BackendInfo
from pyserve.worker.backends.torch.activations import gated_activation as reference_activation
from pyserve.worker.backends.torch.attention import (
    ReferenceAttention,
    TorchAttentionMetadata,
    split_qkv,
)
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.models.config import ModelConfig

if TYPE_CHECKING:
    from pyserve.worker.weight_packing import QuantizedLayers


class TorchBackend(Backend):
    name = "torch"

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        reason: str = "asked for",
        *,
        max_chunk_tokens: int | None = None,  # ReferenceAttention's
    ) -> None:
        super().__init__(config, device, reason)
        self.max_chunk_tokens = max_chunk_tokens
        self.reference: ReferenceAttention | None = None

    @classmethod
    def auto_choice(cls, device: torch.device) -> tuple[bool, str]:
        # last in the registry: it runs wherever no other backend claims the device
        return True, f"device {device.type}: no kernels of ours run there"

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> PagedKVCache:
        cache = super().allocate_kv_cache(num_blocks, block_size, dtype)
        self.reference = ReferenceAttention(cache, self.max_chunk_tokens)
        return cache

    def info(self) -> BackendInfo:
        ops = ("attention", "rms_norm", "gated_activation", "rope_kv", "linear")
        return BackendInfo(self.name, self.reason, dict.fromkeys(ops, "torch"))

    def quantized_layers(self, quantization: str) -> QuantizedLayers:
        if self.device.type == "cpu":
            from pyserve.worker.backends.cpu.quant_linear import CPU_QUANTIZED_LAYERS

            return CPU_QUANTIZED_LAYERS
        from pyserve.worker.backends.triton.backend import triton_usable

        problem = triton_usable(self.device)
        if problem is not None:
            raise ValueError(
                f"quantization {quantization} on {self.device} runs on Triton kernels, "
                f"which cannot run: {problem}"
            )
        from pyserve.worker.backends.triton.quant_matmul import triton_quantized_layers

        return triton_quantized_layers(self.device)

    # ------------------------------------------------------------------ per forward

    def prepare(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        assert self.reference is not None, "allocate_kv_cache first"
        return self.reference.prepare(batch)

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError("the residual must have x's shape and dtype")
            x = residual.add_(x)
        return F.rms_norm(x, weight.shape, weight, eps)

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return reference_activation(gate_up, activation, self.config)

    def attention(self, layer, qkv, cos, signed_sin, metadata, qk_norm=None):
        q, k, v = split_qkv(layer, qkv, cos, signed_sin, qk_norm)
        return self.attend_qkv(layer, q, k, v, metadata).reshape(q.shape[0], -1)

    def attend_qkv(self, layer, q, k, v, metadata):
        """ReferenceAttention.attend_qkv's (the tests drive attention alone through it)."""
        assert self.reference is not None, "allocate_kv_cache first"
        return self.reference.attend_qkv(layer, q, k, v, metadata)
