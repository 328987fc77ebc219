"""The decoder shared by every family, over the paged KV cache: it computes what the ModelConfig
describes and calls only backend ops (pyserve/worker/backends/base.py).

A block: norm → attention (fused q/k/v projection; q/k norm, RoPE from the layer's table, the
layer's window, scale, soft-cap and sinks, inside the backend) → [norm] → residual → norm →
gated MLP (fused gate/up projection; SiLU, GELU-tanh or gpt-oss's clamped SwiGLU), or a mixture
of such MLPs (models/moe.py) → [norm] → residual; the bracketed norms are Gemma's "sandwich".
With tensor parallelism (``tp``; the config is then one rank's share), the outputs of o_proj and
down_proj (of the MLP or of every expert) are summed over the ranks, and the embedding and the
logits are completed from every rank's slice of the vocabulary. The residual connections are
added by the next norm in the same pass (``rms_norm(x, residual)``). Weights are stored [out, in] as
in the checkpoints; q/k/v and gate/up are concatenated at load so each block runs 4 matmuls
instead of 7. The batch is flat: [T, ...] rows from every request, no padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.worker.backends.base import AttentionLayer, Backend, QKNorm
from pyserve.worker.linear import Linear
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.moe import SparseMoE
from pyserve.worker.rope import RotaryTable

if TYPE_CHECKING:
    from pyserve.worker.tensor_parallel import TensorParallel


def _weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """weight · x̂ (the loaders fold a family's (offset + w) into ``weight``)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _weight(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, backend: Backend, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """norm(x), or with ``residual``: residual += x (in place), then norm(residual)."""
        return backend.rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        rope_table: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.index = index
        self.tp = tp
        self.rope_table = rope_table  # which of the model's rope tables this layer rotates with
        self.activation = config.activation
        hidden, inter, eps = config.hidden_size, config.intermediate_size, config.rms_norm_eps
        kw = {"dtype": dtype, "device": device}
        # float32 whatever the model's dtype: every backend's softmax takes them so (exact for
        # bf16/fp16 checkpoints' values), with no cast a step
        self.sinks = (
            _weight(config.num_heads, dtype=torch.float32, device=device)
            if config.attention_sinks
            else None
        )
        self.attn = AttentionLayer.of(config, index, self.sinks)
        self.attn_norm = RMSNorm(hidden, eps, **kw)
        qkv_size = config.q_size + 2 * config.kv_size  # q, k and v heads side by side
        self.qkv_proj = Linear(hidden, qkv_size, bias=config.qkv_bias, **kw)
        full = config.qk_norm_full_width  # one norm over all of q's heads (OLMoE)
        q_width, k_width = (config.q_size, config.kv_size) if full else (config.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, eps, **kw) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, eps, **kw) if config.qk_norm else None
        self.full_width_qk_norm = config.qk_norm and full
        # the backend's view of per-head norms (the loaders fill the same parameters in place)
        self.qk_norm = (
            QKNorm(self.q_norm.weight, self.k_norm.weight, eps)
            if self.q_norm is not None and self.k_norm is not None and not full
            else None
        )
        self.o_proj = Linear(config.q_size, hidden, bias=config.o_bias, **kw)
        sandwich = config.sandwich_norms
        self.attn_out_norm = RMSNorm(hidden, eps, **kw) if sandwich else None
        self.mlp_norm = RMSNorm(hidden, eps, **kw)
        # a dense gated MLP, or a mixture of experts (models/moe.py)
        moe = config.moe if config.layers[index].moe else None
        self.moe = SparseMoE(hidden, moe, **kw) if moe is not None else None
        dense = self.moe is None
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False, **kw) if dense else None
        self.down_proj = Linear(inter, hidden, bias=False, **kw) if dense else None
        self.mlp_out_norm = RMSNorm(hidden, eps, **kw) if sandwich else None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        backend: Backend,
        metadata: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it). ``residual`` None: ``hidden`` is
        the embedding, the stream's start."""
        if residual is None:
            residual = hidden
            normed = self.attn_norm(hidden, backend)
        else:
            normed = self.attn_norm(hidden, backend, residual)  # residual += previous MLP output
        qkv = self.qkv_proj(normed)
        if self.full_width_qk_norm:
            qkv = self._full_width_qk_norm(qkv, backend)
        attn = backend.attention(self.attn, qkv, cos, signed_sin, metadata, self.qk_norm)
        attn = self.o_proj(attn)
        if self.tp is not None:
            attn = self.tp.all_reduce(attn)
        if self.attn_out_norm is not None:
            attn = self.attn_out_norm(attn, backend)
        mlp_in = self.mlp_norm(attn, backend, residual)  # residual += attn
        if self.moe is not None:
            out = self.moe(mlp_in, backend, self.activation)
        else:
            assert self.gate_up_proj is not None and self.down_proj is not None
            gate_up = self.gate_up_proj(mlp_in)
            out = self.down_proj(backend.gated_activation(gate_up, self.activation))
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out, backend)
        return out, residual

    def _full_width_qk_norm(self, qkv: torch.Tensor, backend: Backend) -> torch.Tensor:
        """qkv with q and k each RMS-normalized over all their heads, in float32 as
        transformers' OLMoE computes it: the backend's RMSNorm over the whole width (so that a
        fast path running the same norm computes the same values), or under tensor parallelism
        with the sum of squares spanning every rank's heads."""
        assert self.q_norm is not None and self.k_norm is not None
        q_size = self.attn.num_heads * self.attn.head_dim
        kv_size = self.attn.num_kv_heads * self.attn.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.tp is None:
            q, k = (
                backend.rms_norm(t, n.weight, n.eps)
                for t, n in ((q, self.q_norm), (k, self.k_norm))
            )
        else:
            q, k = self._norm_across_ranks(q, self.q_norm), self._norm_across_ranks(k, self.k_norm)
        return torch.cat([q, k, v], dim=-1)

    def _norm_across_ranks(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        assert self.tp is not None
        wide = x.float()
        total = self.tp.all_reduce(wide.pow(2).sum(-1, keepdim=True))
        mean = total / (x.shape[-1] * self.tp.size)
        return norm.weight * (wide * torch.rsqrt(mean + norm.eps)).to(x.dtype)


class CausalLM(nn.Module):
    """Embedding → decoder layers → final norm → vocabulary projection, for any family."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,  # the served context (longrope's table choice)
        tp: TensorParallel | None = None,  # config is then this rank's share
    ):
        super().__init__()
        self.config = config
        self.tp = tp
        kw = {"dtype": dtype, "device": device}
        context = max_model_len or config.context_length
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, **kw)
        tables: dict[tuple, int] = {}
        for layer in config.layers:
            tables.setdefault(layer.rope.key(), len(tables))
        ropes = {layer.rope.key(): layer.rope for layer in config.layers}
        self.rotary = [RotaryTable(ropes[key], device, context) for key in tables]
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tables[layer.rope.key()], tp=tp, **kw)
            for i, layer in enumerate(config.layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, weight=tied, **kw)
        self.embedding_scale = (
            None
            if config.embedding_scale is None
            else torch.tensor(config.embedding_scale, dtype=torch.float32).to(dtype)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        sample_index: torch.Tensor,
        backend: Backend,
        metadata: object,
        hidden_index: torch.Tensor | None = None,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """float32 logits [S, vocab] for the rows in ``sample_index`` only; with
        ``hidden_index``, also the float32 final-norm hidden states [H, hidden] of those rows
        (what HF's ``AutoModel(...).last_hidden_state`` gives): (logits, hidden). Rows
        ``image_rows`` take ``image_embeds`` in place of their tokens' embeddings; rope turns
        by ``rope_positions`` ([3, T], multimodal rope) where given."""
        hidden, ropes = self.layer_inputs(
            input_ids, positions, image_rows, image_embeds, rope_positions
        )
        hidden, residual = self.run_layers(hidden, ropes, backend, metadata)
        return self.outputs(hidden, residual, sample_index, backend, hidden_index)

    # The three stages of ``forward``: a backend's fast path (the runner's choice, once a step)
    # may compute the middle one, every layer, at once.

    def layer_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(the scaled token embeddings, every rope table's (cos, signed_sin) at ``positions``);
        rows ``image_rows`` hold ``image_embeds`` instead, unscaled (as transformers' vision
        models place them after the text embedding's scale)."""
        hidden = self.embed(input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        if image_rows is not None:
            assert image_embeds is not None
            hidden[image_rows] = image_embeds.to(hidden.dtype)
        if rope_positions is not None:
            positions = rope_positions
        return hidden, [table.cos_sin(positions, hidden.dtype) for table in self.rotary]

    def run_layers(
        self,
        hidden: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        backend: Backend,
        metadata: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer over the embeddings: (the last MLP output, the residual stream it
        adds to)."""
        residual = None  # the residual stream, a fresh tensor each layer adds into in place
        for layer in self.layers:
            cos, sin = ropes[layer.rope_table]
            hidden, residual = layer(hidden, residual, cos, sin, backend, metadata)
        assert residual is not None
        return hidden, residual

    def outputs(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        sample_index: torch.Tensor,
        backend: Backend,
        hidden_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s outputs from the last layer's: the final norm, then the logits."""
        pooled = None
        if hidden_index is not None:  # before the norm below, which adds into its residual
            pooled = self.norm(
                hidden.index_select(0, hidden_index),
                backend,
                residual.index_select(0, hidden_index),
            ).float()
        # the last residual add, norm and vocabulary projection only for rows that sample
        last = self.norm(
            hidden.index_select(0, sample_index), backend, residual.index_select(0, sample_index)
        )
        logits = self.lm_head(last).float()
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if pooled is None else (logits, pooled)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings: a float table, or a packed one (the CPU kernels'
        QuantEmbedding) that dequantizes the rows it reads."""
        if self.tp is not None:
            return self.tp.embed(self.embed_tokens, input_ids)
        if isinstance(self.embed_tokens, nn.Module):
            return self.embed_tokens(input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def pack_weights(self) -> int:
        """Prepacks every projection for the CPU GEMM (after loading); returns how many packed."""
        # Only plain Linear modules: a backend's quantized layers hold packed weights.
        tied = self.config.tie_word_embeddings
        packed = sum(
            m.pack() for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head
        )
        if isinstance(self.lm_head, Linear):
            packed += self.lm_head.pack(keep_weight=tied)
        return packed
