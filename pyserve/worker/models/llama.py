"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Pre-norm blocks: RMSNorm → attention (fused qkv projection, RoPE, grouped-query attention through
the attention backend) → residual → RMSNorm → SwiGLU MLP (fused gate/up projection) → residual.
Weights are stored [out, in] as in the checkpoints (``Linear`` may prepack them for oneDNN after
loading); q/k/v and gate/up are concatenated at load so each block runs 4 matmuls instead of 7.
The batch is flat: [T, ...] rows from every request, no padding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.worker import layer_ops
from pyserve.worker.attention.base import AttentionBackend
from pyserve.worker.linear import Linear
from pyserve.worker.loading.base import ModelLoadError
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.rope import RotaryEmbedding

if TYPE_CHECKING:
    from pyserve.worker.cpu_decoder import CpuDecoderStack

# Checkpoint tensors that hold no weights (old checkpoints saved rope tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _weight(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with ``residual``: residual += x (in place), then norm(residual)."""
        # one pass in C++ on the CPU (layer_ops.py), torch's ops elsewhere
        return layer_ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, index: int, *, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.index = index
        hidden, inter = config.hidden_size, config.intermediate_size
        kw = {"dtype": dtype, "device": device}
        self.input_norm = RMSNorm(hidden, config.rms_norm_eps, **kw)
        qkv_size = config.q_size + 2 * config.kv_size  # q, k and v heads side by side
        self.qkv_proj = Linear(hidden, qkv_size, bias=config.qkv_bias, **kw)
        self.o_proj = Linear(config.q_size, hidden, bias=config.o_bias, **kw)
        self.post_attention_norm = RMSNorm(hidden, config.rms_norm_eps, **kw)
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False, **kw)
        self.down_proj = Linear(inter, hidden, bias=False, **kw)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        attention: AttentionBackend,
        metadata: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): the residual connections are added
        by the next norm, in the same pass (``RMSNorm(x, residual)``), not by separate adds.
        ``residual`` None: ``hidden`` is the embedding, the stream's start."""
        rows = hidden.shape[0]
        if residual is None:
            residual = hidden
            normed = self.input_norm(hidden)
        else:
            normed = self.input_norm(hidden, residual)  # residual += previous MLP output
        qkv = self.qkv_proj(normed)
        # RoPE, the KV-cache write and attention (rotation and write fused where the backend can)
        attn = attention.forward_qkv(self.index, qkv, cos, signed_sin, metadata)
        attn = self.o_proj(attn.reshape(rows, -1))
        gate_up = self.gate_up_proj(self.post_attention_norm(attn, residual))  # residual += attn
        return self.down_proj(layer_ops.silu_mul(gate_up)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str = "cpu"
    ):
        super().__init__()
        self.config = config
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, **kw) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, weight=tied, **kw)
        self.rotary = RotaryEmbedding(config, device)
        # all decoder layers in one C++ call, set by the model runner where it applies
        # (cpu_decoder.py); None: the layers' modules
        self.decoder_stack: CpuDecoderStack | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        sample_index: torch.Tensor,
        attention: AttentionBackend,
        metadata: object,
    ) -> torch.Tensor:
        """float32 logits [S, vocab] for the rows in ``sample_index`` only."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, signed_sin = self.rotary.cos_sin(positions, hidden.dtype)
        if self.decoder_stack is not None:
            hidden, residual = self.decoder_stack.run(hidden, cos, signed_sin, metadata)
        else:
            residual = None  # the residual stream, a fresh tensor each layer adds into in place
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, cos, signed_sin, attention, metadata)
        # the last residual add, norm and vocabulary projection only for rows that sample
        last = self.norm(
            hidden.index_select(0, sample_index), residual.index_select(0, sample_index)
        )
        return self.lm_head(last).float()

    # ------------------------------------------------------------------ loading

    def _weight_slots(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name → the (slice of a) parameter it fills."""
        cfg = self.config
        q, kv = cfg.q_size, cfg.kv_size
        inter = cfg.intermediate_size
        slots: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens,
            "model.norm.weight": self.norm.weight,
        }
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = layer.input_norm.weight
            slots[p + "post_attention_layernorm.weight"] = layer.post_attention_norm.weight
            qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for proj, (lo, hi) in qkv_rows.items():
                slots[p + f"self_attn.{proj}.weight"] = layer.qkv_proj.weight[lo:hi]
                if layer.qkv_proj.bias is not None:
                    slots[p + f"self_attn.{proj}.bias"] = layer.qkv_proj.bias[lo:hi]
            slots[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
            if layer.o_proj.bias is not None:
                slots[p + "self_attn.o_proj.bias"] = layer.o_proj.bias
            slots[p + "mlp.gate_proj.weight"] = layer.gate_up_proj.weight[:inter]
            slots[p + "mlp.up_proj.weight"] = layer.gate_up_proj.weight[inter:]
            slots[p + "mlp.down_proj.weight"] = layer.down_proj.weight
        return slots

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copies checkpoint tensors (HF names, [out, in]) into place; every weight must appear."""
        slots = self._weight_slots()
        missing = set(slots)
        for name, tensor in tensors:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            target = slots.get(name)
            if target is None:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(target.shape)}"
                )
            target.copy_(tensor)
            missing.discard(name)
        if missing:
            shown = ", ".join(sorted(missing)[:5])
            raise ModelLoadError(f"{source}: {len(missing)} weights missing, e.g. {shown}")

    def pack_weights(self) -> int:
        """Prepacks every projection for the CPU GEMM (after loading); returns how many packed."""
        # Only plain Linear modules: quantized ones (pyserve.worker.quant) hold packed weights.
        tied = self.config.tie_word_embeddings
        packed = sum(
            m.pack() for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head
        )
        if isinstance(self.lm_head, Linear):
            packed += self.lm_head.pack(keep_weight=tied)
        return packed
