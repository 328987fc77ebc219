"""The decoder layers in one C++ call on the CPU: `pyserve._kernels.DecoderStack`.

A forward through the layer modules makes ~9 kernel calls a layer, each behind a module call,
argument checks and a fresh output tensor; at batch 32 that Python is ~9% of a decode step, time
in which the kernels' second thread waits. The stack runs the same kernel calls, in the same
order, on the same values, from C++ (cpp/kernels/decoder_stack.cpp): the logits are bit for bit
the layer loop's (tested). Python keeps the embedding lookup, the per-forward metadata, the final
norm and the output projection.

``build`` reads the model's description (models/config.py) and the backend's kernel plan, and
refuses, saying why, any model whose layers compute something the stack does not: then the layer
loop runs, and the model computed is the one loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyserve.worker import quant
from pyserve.worker.attention_kernel import DTYPE_CODES, PrefillAttention
from pyserve.worker.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from pyserve.worker.backends.cpu_kernels import CpuKernelsMetadata, KernelPlan
    from pyserve.worker.models.decoder import CausalLM


def _linear(module: torch.nn.Module) -> tuple[int, ...] | None:
    """The stack's arguments for a kernel-backed linear layer at every batch size, else None."""
    if not isinstance(module, quant.QuantLinear) or module.max_kernel_rows is not None:
        return None
    return (*module.weight_args, module.activation_bits)


def _float32_vector(t: torch.Tensor, size: int) -> bool:
    return t.dtype == torch.float32 and t.shape == (size,) and t.is_contiguous()


def unsupported(model: CausalLM, kv_cache: PagedKVCache, plan: KernelPlan) -> str | None:
    """Why the stack cannot run this model exactly, or None."""
    cfg = model.config
    beyond_llama = {
        "q/k norm": cfg.qk_norm,
        "sandwich norms": cfg.sandwich_norms,
        f"activation {cfg.activation}": cfg.activation != "silu",
        "attention softcap": cfg.attn_softcap is not None,
        "sliding windows": any(layer.sliding_window for layer in cfg.layers),
        "several rope tables": len({layer.rope.key() for layer in cfg.layers}) > 1,
        "partial rotary": any(layer.rope.rotary_dim != cfg.head_dim for layer in cfg.layers),
    }
    missing = [name for name, present in beyond_llama.items() if present]
    if missing:
        return f"the stack does not compute {', '.join(missing)}"
    if not (plan.decode_attention and plan.prefill_attention):
        return "the attention kernels are not in use"
    if not plan.fused_ops:
        return "the fused layer ops are not in use"
    if model.embed_tokens.dtype != torch.float32:
        return f"the model runs in {model.embed_tokens.dtype}, the stack in float32"
    if kv_cache.k[0].dtype not in DTYPE_CODES:
        return f"a {kv_cache.k[0].dtype} cache"
    if len(kv_cache.k) != len(model.layers):
        return "the cache has another number of layers"
    eps = {model.layers[0].attn_norm.eps}
    for i, layer in enumerate(model.layers):
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if any(_linear(m) is None for m in linears):
            return f"layer {i}: a linear layer is not on the kernels at every batch size"
        norms = (layer.attn_norm, layer.mlp_norm)
        if not all(_float32_vector(n.weight, cfg.hidden_size) for n in norms):
            return f"layer {i}: norm weights are not float32 [hidden]"
        if len({n.eps for n in norms} | eps) != 1:
            return "the norms' eps differ"
        if not (kv_cache.k[i].is_contiguous() and kv_cache.v[i].is_contiguous()):
            return "a cache tensor is not contiguous"
    return None


class CpuDecoderStack:
    """The C++ stack of one model and its cache; the backend calls ``run`` in place of the
    layer loop."""

    def __init__(self, stack: object) -> None:
        self._stack = stack

    @classmethod
    def build(
        cls, model: CausalLM, kv_cache: PagedKVCache, plan: KernelPlan
    ) -> tuple[CpuDecoderStack | None, str]:
        """(the stack, "") where it applies, else (None, why not)."""
        reason = unsupported(model, kv_cache, plan)
        if reason:
            return None, reason
        cfg = model.config
        kv_heads, num_blocks, block_size, head_dim = kv_cache.v[0].shape
        stack = quant.kernels().DecoderStack(
            hidden=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            eps=model.layers[0].attn_norm.eps,
            cache_dtype=DTYPE_CODES[kv_cache.k[0].dtype],
            num_blocks=num_blocks,
            block_size=block_size,
        )
        for i, layer in enumerate(model.layers):
            stack.add_layer(
                layer.attn_norm.weight.data_ptr(),
                layer.mlp_norm.weight.data_ptr(),
                _linear(layer.qkv_proj),
                _linear(layer.o_proj),
                _linear(layer.gate_up_proj),
                _linear(layer.down_proj),
                kv_cache.k[i].data_ptr(),
                kv_cache.v[i].data_ptr(),
            )
        return cls(stack), ""

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: CpuKernelsMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the embeddings ``hidden`` (float32 [T, hidden], overwritten):
        (the last layer's MLP output, the residual stream it adds to), as the layer loop
        returns them."""
        hidden = hidden.contiguous()
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        residual = torch.empty_like(hidden)
        slots = metadata.slots.contiguous()
        prefill = metadata.prefill
        spans = tables = None
        if isinstance(prefill, PrefillAttention) and len(prefill.spans):
            spans, tables = prefill.spans, prefill.block_tables.long()
        decode = metadata.decode
        decode_rows = decode_tables = contexts = None
        if decode is not None:
            decode_rows, decode_tables = decode.token_index, decode.call.block_tables.long()
            contexts = decode.call.context_lens.long()
        self._stack.forward(
            hidden.shape[0], hidden.data_ptr(), residual.data_ptr(),
            cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
            0 if spans is None else spans.data_ptr(), 0 if spans is None else spans.shape[0],
            0 if tables is None else tables.data_ptr(), 0 if tables is None else tables.shape[1],
            0 if decode_rows is None else decode_rows.shape[0],
            0 if decode_rows is None else decode_rows.data_ptr(),
            0 if decode_tables is None else decode_tables.data_ptr(),
            0 if decode_tables is None else decode_tables.shape[1],
            0 if contexts is None else contexts.data_ptr(),
            scale,
        )  # fmt: skip
        return hidden, residual
