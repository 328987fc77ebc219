"""The CPU kernels backend: `pyserve._kernels` (AVX-512 VNNI / AVX2 / portable loops) for
attention over the paged cache, the fused layer ops and, where every piece of the model runs on
them, all decoder layers in one C++ call (stack.py).

``KernelPlan`` is the one place that decides what runs on the kernels, from the machine (the
kernels' instruction set) and the model's description: per layer, whether its attention and its
rope + KV write run on the kernels, and whether the whole stack does. What the kernels cannot
compute for a layer (a feature they lack) runs on the torch reference's attention
(backends/torch/attention.py), so the model computed is always the one loaded.

Attention on the kernels reads K and V in place from the cache through each request's block
table, with no gather copy and one pass of online softmax: all prefill chunks of the batch in one
call (AVX-512 only: its portable loops are slower than SDPA), then all decodes in another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from pyserve.worker import quant
from pyserve.worker.backends.base import (
    AttentionLayer,
    Backend,
    BackendInfo,
    ForwardOutput,
    QKNorm,
)
from pyserve.worker.backends.common import EntrySplit, check_batch, table_rows_and_slots
from pyserve.worker.backends.cpu import layer_ops
from pyserve.worker.backends.cpu.attention_kernel import (
    DTYPE_CODES,
    DecodeAttention,
    PrefillAttention,
    attention_features,
    kernel_available,
)
from pyserve.worker.backends.cpu.experts import ExpertKernels, KernelRouter
from pyserve.worker.backends.cpu.quant_linear import CPU_QUANTIZED_LAYERS, QuantLinear
from pyserve.worker.backends.cpu.stack import CpuDecoderStack
from pyserve.worker.backends.torch.attention import (
    ReferenceAttention,
    TorchAttentionMetadata,
    split_qkv,
)
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.linear import Linear
from pyserve.worker.models.config import ModelConfig

if TYPE_CHECKING:
    from pyserve.worker.models.decoder import CausalLM
    from pyserve.worker.weight_packing import QuantizedLayers

log = logging.getLogger("pyserve.worker")
_ISA_NAMES = {"avx512_vnni": "AVX-512 VNNI", "avx2": "AVX2", "scalar": "portable loops"}
# Continuing entries of at most this many tokens (a verify entry: the last token and its drafts)
# attend as decode rows: the decode kernel splits a long context across threads, the prefill
# kernel does not, and a few queries leave it idle (benchmarks/RESULTS.md, "Speculative decoding"
# and "Draft lengths after a miss, and verify entries of 9 tokens as decode rows"). 16: above
# the default 8 drafts' 9 rows.
SHORT_ENTRY_DECODE_ROWS = 16


def kernels_isa() -> str | None:
    """The instruction set the compiled kernels run here, or None where they did not import."""
    if not kernel_available():
        return None
    return quant.kernels().isa()


@dataclass
class LayerPlan:
    attention: str  # "kernels" or "torch: <why>"
    rope_kv: str  # "fused" (rope + KV write in one kernel pass) or "torch: <why>"

    @property
    def attention_on_kernels(self) -> bool:
        return self.attention == "kernels"

    @property
    def fused_rope(self) -> bool:
        return self.rope_kv == "fused"


@dataclass
class KernelPlan:
    isa: str
    decode_attention: bool  # the decode kernel (any ISA)
    prefill_attention: bool  # the prefill kernel (AVX-512 VNNI)
    fused_ops: bool  # fused RMSNorm, SiLU·up, rope + KV write (AVX-512 VNNI)
    activation: str  # "kernels" or "torch: <why>"
    layers: list[LayerPlan] = field(default_factory=list)
    stack: str = "not built"  # "on", or why not
    experts: str | None = None  # a mixture's experts: on how many layers the grouped matmuls run
    router: str | None = None  # a mixture's router: on how many layers the kernel routes
    torch_threads: str | None = None  # set where torch's own threads were cut, and why

    @classmethod
    def decide(cls, config: ModelConfig, cache_dtype: torch.dtype) -> KernelPlan:
        isa = quant.kernels().isa() if kernel_available() else "none"
        features = attention_features()
        # int8 K/V (values and a float16 scale per 32) where the compiled attention reads them
        int8 = cache_dtype == torch.int8 and "int8_q8_0" in features
        decode = kernel_available() and (cache_dtype in DTYPE_CODES or int8)
        prefill = decode and isa == "avx512_vnni"
        fused = layer_ops.fused_kernels() is not None
        if not fused:
            activation = "torch: the fused layer ops need AVX-512"
        elif config.activation == "silu" or config.activation in layer_ops.fused_activations():
            activation = "kernels"
        else:
            activation = f"torch: no {config.activation} kernel"
        plan = cls(isa, decode, prefill, fused, activation)
        for layer in config.layers:
            missing = []
            if layer.sliding_window and "window" not in features:
                missing.append("sliding window")
            if config.attn_softcap is not None and "softcap" not in features:
                missing.append("softcap")
            if config.attention_sinks and "sinks" not in features:
                missing.append("sinks")
            if not decode:
                attention = "torch: no attention kernel for this cache"
            elif missing:
                attention = f"torch: the kernels have no {' or '.join(missing)}"
            else:
                attention = "kernels"
            rope_missing = []
            if config.qk_norm and "qk_norm" not in layer_ops.rope_features():
                rope_missing.append("q/k norm")
            if (
                layer.rope.rotary_dim != config.head_dim
                and "partial" not in layer_ops.rope_features()
            ):
                rope_missing.append("partial rotary")
            if cache_dtype == torch.int8 and "int8_q8_0" not in layer_ops.rope_features():
                rope_missing.append("int8 K/V store")
            if not (fused and prefill and attention == "kernels"):
                rope_kv = "torch: rope + KV write is fused only with both attention kernels"
            elif rope_missing:
                rope_kv = f"torch: the fused rope has no {' or '.join(rope_missing)}"
            else:
                rope_kv = "fused"
            plan.layers.append(LayerPlan(attention, rope_kv))
        return plan

    def summary(self) -> dict[str, str]:
        def per_layer(values: list[str]) -> str:
            counts: dict[str, int] = {}
            for v in values:
                counts[v] = counts.get(v, 0) + 1
            if len(counts) == 1:
                return next(iter(counts))
            return "; ".join(f"{n} layers {v}" for v, n in counts.items())

        return {
            "isa": self.isa,
            "attention": per_layer([p.attention for p in self.layers]),
            "prefill_attention": "kernels" if self.prefill_attention else "torch (SDPA)",
            "rope_kv": per_layer([p.rope_kv for p in self.layers]),
            "rms_norm": "kernels" if self.fused_ops else "torch",
            "gated_activation": self.activation,
            "decoder_stack": self.stack,
            **({"experts": self.experts} if self.experts is not None else {}),
            **({"moe_router": self.router} if self.router is not None else {}),
            **({"torch_threads": self.torch_threads} if self.torch_threads is not None else {}),
        }


@dataclass
class DecodeKernelBatch:
    token_index: torch.Tensor  # int64 [D]: batch rows of the single-token entries
    call: DecodeAttention  # their block tables and context lengths, checked once per forward


@dataclass
class CpuKernelsMetadata:
    batch: ForwardBatch
    slots: torch.Tensor  # int64 [T]: cache slot of each new token
    num_tokens: int
    all_decode: bool
    prefill: PrefillAttention | None  # the kernel's call for every prefill chunk, if it runs
    decode: DecodeKernelBatch | None
    torch: TorchAttentionMetadata | None = None  # built on first use by a torch layer


def _every_projection_on_the_kernels(model: CausalLM) -> bool:
    """Whether every projection is a QuantLinear that never falls back to torch's matmul."""
    linears = [m for m in model.modules() if isinstance(m, (Linear, QuantLinear))]
    return all(isinstance(m, QuantLinear) and m.max_kernel_rows is None for m in linears)


class CpuKernelsBackend(Backend):
    name = "cpu-kernels"

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        reason: str,
        *,
        use_stack: bool = True,  # False: the layer loop (tests compare the two)
        max_chunk_tokens: int | None = None,  # ReferenceAttention's, for the torch layers
    ) -> None:
        super().__init__(config, device, reason)
        self.plan: KernelPlan | None = None
        self.stack: CpuDecoderStack | None = None
        self.use_stack = use_stack
        self.max_chunk_tokens = max_chunk_tokens
        self.reference: ReferenceAttention | None = None  # what the kernels do not cover
        # each mixture's router on the kernels (by id() of its SparseMoE), for float32 tokens
        self.expert_routers: dict[int, KernelRouter] = {}

    @classmethod
    def auto_choice(cls, device: torch.device) -> tuple[bool, str] | None:
        if device.type != "cpu":
            return None
        isa = kernels_isa()
        if isa is None:
            return False, "pyserve._kernels did not import"
        if isa == "scalar":  # torch's own kernels are faster than the portable loops
            return False, "no AVX2 on this CPU"
        return True, _ISA_NAMES.get(isa, isa)

    @classmethod
    def asked_for(cls, device: torch.device) -> str:
        if device.type != "cpu":
            raise ValueError(f"the cpu-kernels backend runs on the CPU, not {device}")
        isa = kernels_isa()
        if isa is None:
            raise ValueError("the cpu-kernels backend needs pyserve._kernels, which did not import")
        return f"asked for ({_ISA_NAMES.get(isa, isa)})"

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> PagedKVCache:
        plan = KernelPlan.decide(self.config, dtype)
        if dtype == torch.int8 and not plan.decode_attention:
            raise ValueError(
                "--kv-cache-dtype int8 on the cpu-kernels backend needs pyserve._kernels' int8 "
                "attention, which this build lacks (rebuild it, or use --backend torch)"
            )
        cache = super().allocate_kv_cache(num_blocks, block_size, dtype)
        self.plan = plan
        self.reference = ReferenceAttention(cache, self.max_chunk_tokens)
        return cache

    def prepare_model(self, model) -> None:
        assert self.plan is not None and self.kv_cache is not None
        # each mixture's experts as grouped matmuls, where every expert is on the kernels (before
        # the stack: grouping moves the experts' weights, which the stack then points into)
        self.plan.experts = self.group_experts(model, ExpertKernels.build)
        moes = [layer.moe for layer in model.layers if layer.moe is not None]
        self.expert_routers = {
            id(moe): router for moe in moes if (router := KernelRouter.build(moe)) is not None
        }
        if moes:
            self.plan.router = f"kernels on {len(self.expert_routers)} of {len(moes)} layers"
        if not self.use_stack:
            self.stack, why = None, "off"
        elif model.tp is not None:
            # the stack runs every layer in one C++ call, with no place for the all-reduces
            self.stack, why = None, "tensor parallel"
        else:
            self.stack, why = CpuDecoderStack.build(
                model, self.kv_cache, self.plan, self.expert_kernels, self.expert_routers
            )
        self.plan.stack = "on" if self.stack is not None else f"off: {why}"
        if self.stack is None and _every_projection_on_the_kernels(model):
            # The layer loop's torch ops are then small ones between kernel calls, and torch's
            # OpenMP threads, spinning after each, would take the cores the kernels' own pool
            # streams the weights on: torch runs on one thread (the pool, sized from torch's
            # threads when first made, keeps its size).
            quant.kernels()
            torch.set_num_threads(1)
            self.plan.torch_threads = "1 (the layer loop's ops beside the kernels' pool)"
        log.info("cpu kernels: %s", ", ".join(f"{k} {v}" for k, v in self.plan.summary().items()))

    def info(self) -> BackendInfo:
        kernels = self.plan.summary() if self.plan else {}
        return BackendInfo(self.name, self.reason, kernels)

    def quantized_layers(self, quantization: str) -> QuantizedLayers:
        return CPU_QUANTIZED_LAYERS

    def fast_path(self, model: CausalLM, batch: ForwardBatch) -> Callable[[], ForwardOutput] | None:
        # the stack ends where the layers do: the model's own outputs serve hidden rows too
        if self.stack is None:
            return None
        return partial(self._stack_forward, model, batch)

    def _stack_forward(self, model: CausalLM, batch: ForwardBatch) -> ForwardOutput:
        assert self.stack is not None
        metadata = self.prepare(batch)
        hidden, ropes = model.layer_inputs(
            batch.input_ids,
            batch.positions,
            batch.image_rows,
            batch.image_embeds,
            batch.rope_positions,
        )
        hidden, residual = self.stack.run(hidden, ropes, metadata, self.config.scale)
        return model.outputs(hidden, residual, batch.sample_index, self, batch.hidden_index)

    # ------------------------------------------------------------------ metadata, once per forward

    def prepare(self, batch: ForwardBatch) -> CpuKernelsMetadata:
        assert self.kv_cache is not None and self.plan is not None
        plan, cache = self.plan, self.kv_cache
        check_batch(batch, cache.block_size)
        table_rows, slots = table_rows_and_slots(batch, cache.block_size, cache.k[0].device)
        split = EntrySplit.of(batch, SHORT_ENTRY_DECODE_ROWS)
        row, spans, decode_entries = split.num_rows, split.spans, split.decode_entries
        prefill = decode = None
        if spans and plan.prefill_attention:
            prefill = PrefillAttention(
                torch.tensor(spans, dtype=torch.int64),
                table_rows[split.prefill_entries],
                num_rows=row,
                num_heads=self.config.num_heads,
                k_cache=cache.k[0],
            )
        if decode_entries and plan.decode_attention:
            every_entry = len(decode_entries) == len(table_rows) == split.num_rows
            tables = table_rows if every_entry else table_rows[decode_entries]
            contexts = torch.tensor(split.decode_contexts, dtype=torch.int64)
            positions = None
            if split.decode_positions:  # a two-way run's rows read past themselves
                positions = torch.tensor(split.decode_positions, dtype=torch.int64)
            call = DecodeAttention(
                tables,
                contexts,
                num_heads=self.config.num_heads,
                k_cache=cache.k[0],
                positions=positions,
            )
            rows = torch.tensor(split.decode_rows, dtype=torch.int64)
            decode = DecodeKernelBatch(rows, call)
        all_decode = len(split.decode_rows) == row
        return CpuKernelsMetadata(batch, slots, row, all_decode, prefill, decode)

    def _torch_metadata(self, meta: CpuKernelsMetadata) -> TorchAttentionMetadata:
        if meta.torch is None:
            assert self.reference is not None
            meta.torch = self.reference.prepare(meta.batch)
        return meta.torch

    # ------------------------------------------------------------------ ops

    def rms_norm(self, x, weight, eps, residual=None):
        return layer_ops.rms_norm(x, weight, eps, residual)  # torch's ops where it cannot run

    def gated_activation(self, gate_up, activation):
        config = self.config  # torch's ops where the kernels cannot run
        return layer_ops.gated_activation(
            gate_up, activation, alpha=config.swiglu_alpha, limit=config.swiglu_limit
        )

    def route_experts(self, moe, x):
        router = self.expert_routers.get(id(moe))
        if router is None or x.dtype != torch.float32:
            return super().route_experts(moe, x)
        return router.route(x)  # the decoder stack's route, to the bit

    def attention(self, layer, qkv, cos, signed_sin, metadata, qk_norm=None):
        meta: CpuKernelsMetadata = metadata  # type: ignore[assignment]
        plan = self.plan.layers[layer.index]  # type: ignore[union-attr]
        if plan.fused_rope and self._fused_rope(layer, qkv, cos, signed_sin, meta, qk_norm):
            heads, dim = layer.num_heads, layer.head_dim
            q = qkv[:, : heads * dim].view(-1, heads, dim)
            return self._attend_kernels(layer, q, None, None, meta).reshape(q.shape[0], -1)
        q, k, v = split_qkv(layer, qkv, cos, signed_sin, qk_norm)
        return self.attend_qkv(layer, q, k, v, meta).reshape(q.shape[0], -1)

    def attend_qkv(self, layer, q, k, v, metadata):
        """ReferenceAttention.attend_qkv's, on the kernels where the plan runs the layer there."""
        meta: CpuKernelsMetadata = metadata  # type: ignore[assignment]
        if not self.plan.layers[layer.index].attention_on_kernels:  # type: ignore[union-attr]
            assert self.reference is not None
            return self.reference.attend_qkv(layer, q, k, v, self._torch_metadata(meta))
        k, v = self.kv_cache.write(layer.index, meta.slots, k, v)  # type: ignore[union-attr]
        return self._attend_kernels(layer, q, k, v, meta)

    def _fused_rope(
        self,
        layer: AttentionLayer,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        meta: CpuKernelsMetadata,
        qk_norm: QKNorm | None,
    ) -> bool:
        cache = self.kv_cache
        assert cache is not None
        return layer_ops.rope_write_kv(
            qkv,
            cos,
            signed_sin,
            meta.slots,
            cache.k[layer.index],
            cache.v[layer.index],
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            q_norm=None if qk_norm is None else qk_norm.q_weight,
            k_norm=None if qk_norm is None else qk_norm.k_weight,
            eps=1e-6 if qk_norm is None else qk_norm.eps,
            **cache.layer_scales(layer.index),
        )

    def _attend_kernels(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: CpuKernelsMetadata,
    ) -> torch.Tensor:
        """Attention of the batch's rows, their K/V already in the cache (k, v: as stored, for
        the torch prefill path; None when the kernels read everything from the cache)."""
        cache = self.kv_cache
        assert cache is not None
        k_cache, v_cache = cache.k[layer.index], cache.v[layer.index]
        # the plan runs a layer with a window, a cap or sinks here only where the kernels
        # compute them
        options = {
            "window": layer.sliding_window or 0,
            "softcap": layer.softcap or 0.0,
            "sinks": layer.sinks,
            **cache.layer_scales(layer.index),
        }
        decode = meta.decode
        if meta.all_decode and decode is not None:
            return decode.call.run(q, k_cache, v_cache, layer.scale, **options)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.prefill is not None:
            meta.prefill.run(q, k_cache, v_cache, layer.scale, out, **options)
        elif not meta.all_decode:  # prefill rows on the torch path (no prefill kernel here)
            assert k is not None and v is not None
            torch_meta = self._torch_metadata(meta)
            assert self.reference is not None
            for span in torch_meta.prefills:
                rows = slice(span.token_start, span.token_start + span.num_tokens)
                out[rows] = self.reference.prefill(layer, q[rows], k[rows], v[rows], span)
        if decode is not None:
            rows_q = q.index_select(0, decode.token_index)
            decoded = decode.call.run(rows_q, k_cache, v_cache, layer.scale, **options)
            out.index_copy_(0, decode.token_index, decoded)
        return out
