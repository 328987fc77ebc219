"""The decoder layers in one C++ call on the CPU: `pyserve._kernels.DecoderStack`.

A forward through the layer modules makes ~9 kernel calls a layer, each behind a module call,
argument checks and a fresh output tensor; at batch 32 that Python is a visible share of a
decode step, time in which the kernels' second thread waits. The stack runs the same kernel
calls, in the same order, on the same values, from C++ (cpp/kernels/decoder_stack.cpp): the
logits are bit for bit the layer loop's (tested). It runs every feature the layer loop runs on
the kernels: q/k norms, Gemma's sandwich norms, SiLU, GELU-tanh or gpt-oss's clamped SwiGLU,
per-layer sliding windows, attention sinks, the attention soft-cap, several rope tables
(partial rotary too), each layer rotating with its own, OLMoE's q/k norms over all heads, and
mixtures of experts: the kernel router (experts.KernelRouter, gpt-oss's router bias and
softmax over the top k included), the grouped experts (experts.ExpertKernels, with their
biases) and a shared expert with its sigmoid gate, the calls SparseMoE makes on this backend.
Python keeps the embedding lookup (and its scale), the rope tables' cos/sin, the per-forward
metadata, the final norm, the output projection and its soft-cap.

``build`` reads the model's description (models/config.py) and the backend's kernel plan, and
refuses, saying why, any model whose layers compute something the stack does not: then the layer
loop runs, and the model computed is the one loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear
from pyserve.worker.backends.cpu.attention_kernel import CACHE_DTYPE_CODES, PrefillAttention
from pyserve.worker.backends.cpu.experts import ExpertKernels, KernelRouter
from pyserve.worker.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pyserve.worker.backends.cpu.backend import CpuKernelsMetadata, KernelPlan
    from pyserve.worker.models.decoder import CausalLM, DecoderLayer
    from pyserve.worker.models.moe import SparseMoE


def _linear(module: torch.nn.Module) -> tuple[int, ...] | list[tuple[int, ...]] | None:
    """The stack's arguments for a kernel-backed linear layer at every batch size (a list of
    them, one per segment, for a projection kept at its parts' precisions), else None."""
    if not isinstance(module, quant_linear.QuantLinear) or module.max_kernel_rows is not None:
        return None
    if isinstance(module.weight_args, list):
        segments = zip(module.weight_args, module.super_scales, module.mxfp4, strict=True)
        return [(*args, module.activation_bits, sup, mx) for args, sup, mx in segments]
    return (*module.weight_args, module.activation_bits, module.super_scales[0], module.mxfp4[0])


def _float32_vector(t: torch.Tensor, size: int) -> bool:
    return t.dtype == torch.float32 and t.shape == (size,) and t.is_contiguous()


def _address(norm: torch.nn.Module | None) -> int:
    return 0 if norm is None else norm.weight.data_ptr()


# the gated activations the stack computes (cpp/kernels/module.cpp, DecoderStack's activation)
STACK_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


def _moe_unsupported(
    moe: SparseMoE,
    hidden: int,
    grouped: Mapping[int, object],
    routers: Mapping[int, KernelRouter],
) -> str | None:
    """Why the stack cannot run this mixture as the layer loop does on this backend, or None."""
    if id(moe) not in routers:
        return f"its router is not on the kernels ({KernelRouter.unsupported(moe) or 'not built'})"
    if not isinstance(grouped.get(id(moe)), ExpertKernels):
        return "its experts are not grouped on the kernels"
    if moe.shared_expert is not None:
        shared = (moe.shared_expert.gate_up_proj, moe.shared_expert.down_proj)
        if any(_linear(m) is None for m in shared):
            return "its shared expert is not on the kernels at every batch size"
    return None


def _full_width_norms_fit(layer: DecoderLayer) -> bool:
    """Whether a full-width q/k norm's weights are float32 [q heads' width], [k heads' width]."""
    attn = layer.attn
    if layer.q_norm is None or layer.k_norm is None:
        return False
    return _float32_vector(layer.q_norm.weight, attn.num_heads * attn.head_dim) and (
        _float32_vector(layer.k_norm.weight, attn.num_kv_heads * attn.head_dim)
    )


def unsupported(
    model: CausalLM,
    kv_cache: PagedKVCache,
    plan: KernelPlan,
    grouped: Mapping[int, object] | None = None,
    routers: Mapping[int, KernelRouter] | None = None,
) -> str | None:
    """Why the stack cannot run this model exactly as the layer loop does, or None. ``grouped``
    and ``routers``: the backend's grouped experts and kernel routers, by id() of each
    SparseMoE (a mixture runs on the stack only with both)."""
    cfg = model.config
    if not (plan.decode_attention and plan.prefill_attention):
        return "the attention kernels are not in use"
    if not plan.fused_ops:
        return "the fused layer ops are not in use"
    if plan.activation != "kernels" or cfg.activation not in STACK_ACTIVATIONS:
        return f"the {cfg.activation} activation runs on {plan.activation}"
    if model.dtype != torch.float32:
        return f"the model runs in {model.dtype}, the stack in float32"
    if kv_cache.k[0].dtype not in CACHE_DTYPE_CODES:
        return f"a {kv_cache.k[0].dtype} cache"
    if len(kv_cache.k) != len(model.layers) or len(plan.layers) != len(model.layers):
        return "the cache or the kernel plan has another number of layers"
    tables = model.rotary
    if not tables or any(
        not (2 <= t.rotary_dim <= cfg.head_dim and t.rotary_dim % 2 == 0) for t in tables
    ):
        return "a rope table's rotary dims are not even in [2, head_dim]"
    first = model.layers[0]
    eps, softcap = first.attn_norm.eps, first.attn.softcap
    for i, layer in enumerate(model.layers):
        layer_plan = plan.layers[i]
        if layer.moe is not None:
            why = _moe_unsupported(layer.moe, cfg.hidden_size, grouped or {}, routers or {})
            if why:
                return f"layer {i}: a mixture of experts: {why}"
        if not layer_plan.attention_on_kernels:
            return f"layer {i}: attention on {layer_plan.attention}"
        if layer.attn.sinks is not None and not _float32_vector(layer.attn.sinks, cfg.num_heads):
            return f"layer {i}: attention sinks are not float32 [heads]"
        if not layer_plan.fused_rope:
            return f"layer {i}: rope + KV write on {layer_plan.rope_kv}"
        linears = [layer.qkv_proj, layer.o_proj]
        if layer.moe is None:
            linears += [layer.gate_up_proj, layer.down_proj]
        if any(_linear(m) is None for m in linears):
            return f"layer {i}: a linear layer is not on the kernels at every batch size"
        hidden_norms = [layer.attn_norm, layer.mlp_norm]
        hidden_norms += [n for n in (layer.attn_out_norm, layer.mlp_out_norm) if n is not None]
        if not all(_float32_vector(n.weight, cfg.hidden_size) for n in hidden_norms):
            return f"layer {i}: norm weights are not float32 [hidden]"
        if (layer.q_norm is None) != (layer.k_norm is None):
            return f"layer {i}: a q norm without a k norm, or a k norm without a q norm"
        head_norms = [n for n in (layer.q_norm, layer.k_norm) if n is not None]
        if layer.full_width_qk_norm:
            if not _full_width_norms_fit(layer):
                return f"layer {i}: full-width q/k norm weights are not float32 [heads · head_dim]"
        elif not all(_float32_vector(n.weight, cfg.head_dim) for n in head_norms):
            return f"layer {i}: q/k norm weights are not float32 [head_dim]"
        if {n.eps for n in hidden_norms + head_norms} != {eps}:
            return "the norms' eps differ"
        if not 0 <= layer.rope_table < len(tables):
            return f"layer {i}: no rope table {layer.rope_table}"
        attn = layer.attn
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            return f"layer {i}: attention heads unlike the model's"
        if attn.scale != cfg.scale or attn.softcap != softcap:
            return "the layers' attention scales or soft-caps differ"
        if not (kv_cache.k[i].is_contiguous() and kv_cache.v[i].is_contiguous()):
            return "a cache tensor is not contiguous"
    return None


def _stack_moe(moe: SparseMoE, experts: ExpertKernels, router: KernelRouter) -> object:
    """The stack's description of a mixture (``_kernels.StackMoE``): the router's address (and
    its bias's), the grouped experts' sets (and their stacked biases) and the shared expert's
    gate and projections."""
    shared = moe.shared_expert

    def address(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    return quant.kernels().StackMoE(
        router=router.router.data_ptr(),
        num_experts=router.router.shape[0],
        top_k=router.top_k,
        normalize=router.normalize,
        gate_up=experts.gate_up,
        down=experts.down,
        activation_bits=experts.activation_bits,
        shared_gate=0 if router.shared_gate is None else router.shared_gate.data_ptr(),
        shared_gate_up=None if shared is None else _linear(shared.gate_up_proj),
        shared_down=None if shared is None else _linear(shared.down_proj),
        router_bias=address(router.bias),
        softmax_after_top_k=router.softmax_after_top_k,
        gate_up_bias=address(experts.gate_up_bias),
        down_bias=address(experts.down_bias),
    )


class CpuDecoderStack:
    """The C++ stack of one model and its cache; the backend's fast path calls ``run`` in place
    of the model's layer loop."""

    def __init__(self, stack: object, rotary_dims: list[int], keep: list[object]) -> None:
        self._stack = stack
        self._rotary_dims = rotary_dims  # each rope table's, for checking the tables given
        self._keep = keep  # what the stack points into beyond the model: the grouped experts

    @classmethod
    def build(
        cls,
        model: CausalLM,
        kv_cache: PagedKVCache,
        plan: KernelPlan,
        grouped: Mapping[int, object] | None = None,
        routers: Mapping[int, KernelRouter] | None = None,
    ) -> tuple[CpuDecoderStack | None, str]:
        """(the stack, "") where it applies, else (None, why not). ``grouped``, ``routers``: as
        ``unsupported`` takes them."""
        grouped, routers = grouped or {}, routers or {}
        reason = unsupported(model, kv_cache, plan, grouped, routers)
        if reason:
            return None, reason
        keep: list[object] = []
        cfg = model.config
        kv_heads, num_blocks, block_size, head_dim = kv_cache.v[0].shape
        stack = quant.kernels().DecoderStack(
            hidden=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            eps=model.layers[0].attn_norm.eps,
            cache_dtype=CACHE_DTYPE_CODES[kv_cache.k[0].dtype],
            num_blocks=num_blocks,
            block_size=block_size,
            activation=cfg.activation,
            softcap=model.layers[0].attn.softcap or 0.0,
            rotary_dims=[table.rotary_dim for table in model.rotary],
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
        )

        for i, layer in enumerate(model.layers):
            moe = None
            if layer.moe is not None:
                experts = grouped[id(layer.moe)]
                assert isinstance(experts, ExpertKernels)
                moe = _stack_moe(layer.moe, experts, routers[id(layer.moe)])
                keep.append(experts)
            stack.add_layer(
                layer.attn_norm.weight.data_ptr(),
                layer.mlp_norm.weight.data_ptr(),
                _linear(layer.qkv_proj),
                _linear(layer.o_proj),
                None if moe is not None else _linear(layer.gate_up_proj),
                None if moe is not None else _linear(layer.down_proj),
                kv_cache.k[i].data_ptr(),
                kv_cache.v[i].data_ptr(),
                q_norm=_address(layer.q_norm),
                k_norm=_address(layer.k_norm),
                attn_out_norm=_address(layer.attn_out_norm),
                mlp_out_norm=_address(layer.mlp_out_norm),
                rope_table=layer.rope_table,
                window=layer.attn.sliding_window or 0,
                full_width_qk_norm=layer.full_width_qk_norm,
                moe=moe,
                sinks=0 if layer.attn.sinks is None else layer.attn.sinks.data_ptr(),
                **{name: t.data_ptr() for name, t in kv_cache.layer_scales(i).items()},
            )
        return cls(stack, [table.rotary_dim for table in model.rotary], keep), ""

    def run(
        self,
        hidden: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: CpuKernelsMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the embeddings ``hidden`` (float32 [T, hidden], overwritten):
        (the last layer's MLP output, the residual stream it adds to), as the layer loop
        returns them. ``ropes``: every rope table's (cos, signed_sin) for the batch's positions
        (float32 [T, 1, rotary_dim] each, RotaryTable.cos_sin), in the model's table order."""
        hidden = hidden.contiguous()
        rows = hidden.shape[0]
        if len(ropes) != len(self._rotary_dims):
            raise ValueError(f"{len(ropes)} rope tables for a stack of {len(self._rotary_dims)}")
        # contiguous copies (where they are not already) stay alive until the forward returns
        rope_tables = [(cos.contiguous(), sin.contiguous()) for cos, sin in ropes]
        for (cos, signed_sin), dim in zip(rope_tables, self._rotary_dims, strict=True):
            if not (
                cos.dtype == signed_sin.dtype == torch.float32
                and cos.numel() == signed_sin.numel() == rows * dim
            ):
                raise ValueError(f"a rope table is not float32 [{rows}, {dim}]")
        cos_addresses = [cos.data_ptr() for cos, _ in rope_tables]
        sin_addresses = [sin.data_ptr() for _, sin in rope_tables]
        residual = torch.empty_like(hidden)
        slots = metadata.slots.contiguous()
        prefill = metadata.prefill
        spans = tables = None
        if isinstance(prefill, PrefillAttention) and len(prefill.spans):
            spans, tables = prefill.spans, prefill.block_tables.long()
        decode = metadata.decode
        decode_rows = decode_tables = contexts = positions = None
        if decode is not None:
            decode_rows, decode_tables = decode.token_index, decode.call.block_tables.long()
            contexts = decode.call.context_lens.long()
            positions = decode.call.positions
        self._stack.forward(
            rows, hidden.data_ptr(), residual.data_ptr(),
            cos_addresses, sin_addresses, slots.data_ptr(),
            0 if spans is None else spans.data_ptr(), 0 if spans is None else spans.shape[0],
            0 if tables is None else tables.data_ptr(), 0 if tables is None else tables.shape[1],
            0 if decode_rows is None else decode_rows.shape[0],
            0 if decode_rows is None else decode_rows.data_ptr(),
            0 if decode_tables is None else decode_tables.data_ptr(),
            0 if decode_tables is None else decode_tables.shape[1],
            0 if contexts is None else contexts.data_ptr(),
            scale,
            0 if positions is None else positions.data_ptr(),
        )  # fmt: skip
        return hidden, residual
