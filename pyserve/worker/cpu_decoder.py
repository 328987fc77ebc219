"""The decoder layers in one C++ call on the CPU: `pyserve._kernels.DecoderStack`.

A forward through the modules (models/llama.py) makes ~9 kernel calls a layer, each behind a
module call, argument checks and a fresh output tensor; at batch 32 that Python is ~9% of a
decode step, time in which the kernels' second thread waits. The stack runs the same kernel
calls, in the same order, on the same values, from C++ (cpp/kernels/decoder_stack.cpp): the
logits are bit for bit the modules' (tested). Python keeps the embedding lookup, the per-forward
metadata (the attention backend's ``prepare``), the final norm and the output projection: the
model's forward (models/llama.py) calls ``run`` in place of its layer loop.

It applies where every piece already runs on the kernels: a float32 Llama-family model whose
linear layers are all kernel-backed ``QuantLinear`` (int4/int8, the default GGUF), the CPU
attention backend with its decode and prefill kernels, and the fused layer ops (AVX-512).
Anything else keeps the module path, as does ``PYSERVE_DECODER_STACK=off``.
"""

from __future__ import annotations

import logging
import os

import torch

from pyserve.worker import layer_ops, quant
from pyserve.worker.attention.cpu import (
    CpuAttentionBackend,
    CpuAttentionMetadata,
    DecodeKernelBatch,
)
from pyserve.worker.attention_kernel import DTYPE_CODES, PrefillAttention
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.models.llama import LlamaForCausalLM

ENV = "PYSERVE_DECODER_STACK"  # "off": always the module path
log = logging.getLogger(__name__)


def _linear(module: torch.nn.Module) -> tuple[int, ...] | None:
    """The stack's arguments for a kernel-backed linear layer at every batch size, else None."""
    if not isinstance(module, quant.QuantLinear) or module.max_kernel_rows is not None:
        return None
    return (*module.weight_args, module.activation_bits)


def _float32_vector(t: torch.Tensor, size: int) -> bool:
    return t.dtype == torch.float32 and t.shape == (size,) and t.is_contiguous()


class CpuDecoderStack:
    """The C++ stack of one model, its cache and attention backend; ``build`` says whether it
    applies, and the model's forward calls ``run`` in place of its layer loop."""

    def __init__(self, stack: object, attention: CpuAttentionBackend):
        self.attention = attention
        self._stack = stack

    @classmethod
    def build(
        cls, model: LlamaForCausalLM, kv_cache: PagedKVCache, attention: object
    ) -> CpuDecoderStack | None:
        """The stack for this model, or None (the module path) where it does not apply."""
        if os.environ.get(ENV, "").lower() == "off":
            return None
        reason = cls._unsupported(model, kv_cache, attention)
        if reason:
            log.debug("decoder stack off: %s", reason)
            return None
        cfg = model.config
        kernels = quant.kernels()
        kv_heads, num_blocks, block_size, head_dim = kv_cache.v[0].shape
        stack = kernels.DecoderStack(
            hidden=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            eps=model.layers[0].input_norm.eps,
            cache_dtype=DTYPE_CODES[kv_cache.k[0].dtype],
            num_blocks=num_blocks,
            block_size=block_size,
        )
        for i, layer in enumerate(model.layers):
            stack.add_layer(
                layer.input_norm.weight.data_ptr(),
                layer.post_attention_norm.weight.data_ptr(),
                _linear(layer.qkv_proj),
                _linear(layer.o_proj),
                _linear(layer.gate_up_proj),
                _linear(layer.down_proj),
                kv_cache.k[i].data_ptr(),
                kv_cache.v[i].data_ptr(),
            )
        return cls(stack, attention)  # type: ignore[arg-type]

    @staticmethod
    def _unsupported(model: object, kv_cache: PagedKVCache, attention: object) -> str | None:
        if not isinstance(model, LlamaForCausalLM):
            return f"{type(model).__name__} is not the Llama-family model"
        if not isinstance(attention, CpuAttentionBackend):
            return "not the CPU attention backend"
        if not (attention.decode_kernel and attention.prefill_kernel):
            return "the attention kernels are not in use"
        if layer_ops.fused_kernels() is None:
            return "the fused layer ops are not in use"
        cfg = model.config
        if model.embed_tokens.dtype != torch.float32:
            return f"the model runs in {model.embed_tokens.dtype}, the stack in float32"
        if kv_cache.k[0].dtype not in DTYPE_CODES:
            return f"a {kv_cache.k[0].dtype} cache"
        if len(kv_cache.k) != len(model.layers):
            return "the cache has another number of layers"
        for i, layer in enumerate(model.layers):
            linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            if any(_linear(m) is None for m in linears):
                return f"layer {i}: a linear layer is not on the kernels at every batch size"
            norms = (layer.input_norm, layer.post_attention_norm)
            if not all(_float32_vector(n.weight, cfg.hidden_size) for n in norms):
                return f"layer {i}: norm weights are not float32 [hidden]"
            if len({n.eps for n in norms} | {model.layers[0].input_norm.eps}) != 1:
                return "the norms' eps differ"
            if not (kv_cache.k[i].is_contiguous() and kv_cache.v[i].is_contiguous()):
                return "a cache tensor is not contiguous"
        return None

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: CpuAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the embeddings ``hidden`` (float32 [T, hidden], overwritten):
        (the last layer's MLP output, the residual stream it adds to), as the layer loop of
        LlamaForCausalLM.forward returns them."""
        hidden = hidden.contiguous()
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        residual = torch.empty_like(hidden)
        slots = metadata.slots.contiguous()
        prefill = metadata.prefills
        spans = tables = None
        if isinstance(prefill, PrefillAttention) and len(prefill.spans):
            spans, tables = prefill.spans, prefill.block_tables.long()
        decode = metadata.decode
        decode_rows = decode_tables = contexts = None
        if decode is not None:
            assert isinstance(decode, DecodeKernelBatch)  # the stack runs with the kernel only
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
            self.attention.scale,
        )  # fmt: skip
        return hidden, residual
