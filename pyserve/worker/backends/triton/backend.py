"""The GPU backend: Triton kernels for attention and the fused ops, torch (cuBLAS) for the
linear layers.

Its KV cache is ``FlatKVCache`` (the layout the Triton kernels read: attention.py).
``prepare`` turns a batch into int32 index tensors on the device once per forward: the slots of
the new tokens, each entry's block table, and, split by kind, the decode rows (one token each,
split-K attention) and the prefill entries (several tokens over a cached prefix). Every layer
then runs rope + K/V store, attention, RMSNorm and the gated activation as Triton kernels. What
the kernels do not cover (q/k norms) is computed with the reference ops first. An int8 cache
(``--kv-cache-dtype int8``) is quantized by the store kernel and read in place by the attention
kernels, each group's scale applied there.

Without a GPU the same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
tensors: slowly, but exactly what the tests need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyserve.worker import env
from pyserve.worker.backends.base import (
    AttentionLayer,
    Backend,
    BackendInfo,
    ForwardOutput,
    QKNorm,
    model_forward,
)
from pyserve.worker.backends.common import EntrySplit, check_batch, table_rows_and_slots
from pyserve.worker.backends.torch.activations import gated_activation as reference_activation
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import FLOAT16_MAX, PagedKVCache, dequantize_int8, quantize_int8

if TYPE_CHECKING:
    from torch import nn

    from pyserve.worker.backends.triton.decode_graphs import DecodeGraphs
    from pyserve.worker.models.decoder import CausalLM
    from pyserve.worker.weight_packing import QuantizedLayers

# split-K for decode: a split per this many positions of the longest context, at most MAX_SPLITS
SPLIT_TOKENS = 256
MAX_SPLITS = 16
GRAPH_MAX_BATCH = 256  # the default --max-running-requests: larger decode steps run eagerly
# a warm-up prefill's rows: past the quantized matmul's largest tile height (64 rows), so that
# every kernel a prefill launches is compiled before the first request
WARM_UP_TOKENS = 80


def fixed_splits(max_context: int) -> int:
    return min(MAX_SPLITS, max(1, -(-max_context // SPLIT_TOKENS)))


def triton_usable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device``, or None if it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'pyserve[gpu]')"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and env.triton_interpret():
        return None
    return (
        f"Triton kernels run on CUDA devices (or on the CPU with TRITON_INTERPRET=1), not {device}"
    )


class FlatKVCache(PagedKVCache):
    """Per layer, K and V as ``[num_blocks * block_size, kv_heads, head_dim]``: slot-major, so
    a token's heads are contiguous and a block of tokens is one strided tile per head. An int8
    cache's scales are ``[num_blocks * block_size, kv_heads, groups]`` float16 per layer (a
    scale per 32 values of a head), slot-major too, with kv_cache.quantize_int8's numerics (the
    store kernel quantizes as it does)."""

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        return shape, shape

    def scale_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.scale_groups)
        return shape, shape

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if self.quantized:
            (qk, k_scale), (qv, v_scale) = quantize_int8(k), quantize_int8(v)
            self.k[layer][slots], self.v[layer][slots] = qk, qv
            self.k_scale[layer][slots], self.v_scale[layer][slots] = k_scale, v_scale
            return dequantize_int8(qk, k_scale), dequantize_int8(qv, v_scale)
        if k.dtype != self.dtype:
            k, v = self._stored(k), self._stored(v)
        self.k[layer][slots] = k
        self.v[layer][slots] = v
        return k, v

    def block_views(self) -> list[tuple[torch.Tensor, int]]:
        # a block's slots are contiguous in every tensor: a view per block along dim 0
        def by_block(t: torch.Tensor) -> torch.Tensor:
            return t.view(self.num_blocks, self.block_size, *t.shape[1:])

        return [(by_block(t), 0) for t in (*self.k, *self.v, *self.k_scale, *self.v_scale)]

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = blocks.reshape(-1)
        out = (self.num_kv_heads, *blocks.shape, self.block_size)

        def gathered(t: torch.Tensor) -> torch.Tensor:
            # [kv_heads, *S, block_size, last dim]: head_dim for K/V, the groups for scales
            by_block = t.view(self.num_blocks, self.block_size, self.num_kv_heads, -1)
            return by_block.index_select(0, flat).movedim(2, 0).reshape(*out, -1)

        k, v = gathered(self.k[layer]), gathered(self.v[layer])
        if self.quantized:
            k_scale, v_scale = gathered(self.k_scale[layer]), gathered(self.v_scale[layer])
            return dequantize_int8(k, k_scale), dequantize_int8(v, v_scale)
        return k, v


@dataclass
class TritonMetadata:
    slots: torch.Tensor  # int64 [T]: cache slot of each new token
    num_tokens: int
    # decode entries: their rows, contexts (own position included) and block tables
    decode_rows: torch.Tensor | None
    decode_context: torch.Tensor | None
    decode_tables: torch.Tensor | None
    max_context: int
    num_splits: int
    split_tokens: torch.Tensor | None  # int32 [1]: positions a decode split covers
    # prefill entries: first row, rows, cached positions before them, block tables
    prefill_start: torch.Tensor | None
    prefill_len: torch.Tensor | None
    prefill_prefix: torch.Tensor | None
    prefill_tables: torch.Tensor | None
    max_prefill_len: int
    # int32 [D]: each decode row's own position, where its window ends (None: context - 1)
    decode_positions: torch.Tensor | None = None


class TritonBackend(Backend):
    name = "triton"
    kv_cache_class = FlatKVCache

    def __init__(
        self,
        config,
        device: torch.device,
        reason: str = "asked for",
        *,
        num_splits: int = 0,
        decode_graphs: str = "auto",
        graph_max_batch: int = GRAPH_MAX_BATCH,
    ) -> None:
        super().__init__(config, device, reason)
        if decode_graphs not in ("auto", "eager", "off"):
            raise ValueError(f"decode_graphs must be auto, eager or off; got {decode_graphs!r}")
        # auto: captured CUDA graphs on a GPU; eager: their static buffers without capture
        # (how the tests check them on the CPU); off: every step through prepare()
        if decode_graphs == "auto":
            decode_graphs = "capture" if device.type == "cuda" else "off"
        self.decode_graphs_mode = decode_graphs
        self.graph_max_batch = graph_max_batch
        self.graphs: DecodeGraphs | None = None
        problem = triton_usable(device)
        if problem is not None:
            raise ValueError(f"the triton backend cannot run: {problem}")
        from pyserve.worker.backends.triton import attention, fused

        self._attention = attention
        self._fused = fused
        self.num_splits = num_splits  # 0: by context length; tests force split-K with it
        self.experts_summary: str | None = None
        self.quantized_linears = 0  # layers built on the 8-/4-bit Triton matmul

    @classmethod
    def auto_choice(cls, device: torch.device) -> tuple[bool, str] | None:
        if device.type != "cuda":
            return None
        problem = triton_usable(device)
        return (False, problem) if problem is not None else (True, "a CUDA device")

    def info(self) -> BackendInfo:
        kernels = dict.fromkeys(("attention", "rms_norm", "gated_activation", "rope_kv"), "triton")
        if self.kv_cache is not None and self.kv_cache.quantized:
            kernels["attention"] = "triton, int8 K/V read in the kernels (a scale per 32 values)"
            kernels["rope_kv"] = "triton, quantizing K/V to int8"
        kernels["linear"] = "torch"
        if self.quantized_linears:
            kernels["linear"] = f"triton 8-/4-bit on {self.quantized_linears} layers, else torch"
        if self.experts_summary is not None:
            kernels["experts"] = self.experts_summary
        if self.graphs is not None:
            kernels["decode"] = f"graphs of {len(self.graphs.sizes)} batch sizes"
        return BackendInfo(self.name, self.reason, kernels)

    def quantized_layers(self, quantization: str) -> QuantizedLayers:
        from pyserve.worker.backends.triton.quant_matmul import triton_quantized_layers

        layers = triton_quantized_layers(self.device)
        build = layers.linear

        def counted(*args, **kwargs) -> nn.Module:
            self.quantized_linears += 1
            return build(*args, **kwargs)

        return dataclasses.replace(layers, linear=counted)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype):
        # one extra block that no request owns: decode graphs pad their batches with rows that
        # write into it, and the warm-up writes its K/V there
        self._scratch_block = num_blocks
        return super().allocate_kv_cache(num_blocks + 1, block_size, dtype)

    def prepare_model(self, model) -> None:
        # each mixture's experts as grouped matmuls where every projection is a plain float
        # layer, stacked before the warm-up so that it compiles the grouped kernel too
        from pyserve.worker.backends.triton.experts import TritonExperts

        self.experts_summary = self.group_experts(model, TritonExperts.of)
        if self.device.type == "cuda":
            self.warm_up(model)
        if self.decode_graphs_mode != "off":
            from pyserve.worker.backends.triton.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                model,
                self,
                max_batch=self.graph_max_batch,
                scratch_block=self._scratch_block,
                capture=self.decode_graphs_mode == "capture",
            )

    def warm_up(self, model) -> None:
        """A prefill and a decode step into the scratch block, their outputs dropped: a GPU
        compiles each Triton kernel the first time it is launched with new constexprs (about
        a second each), which would otherwise fall on the first requests' TTFT."""
        cache = self.kv_cache
        assert cache is not None, "allocate_kv_cache first"
        n, bs = WARM_UP_TOKENS, cache.block_size
        table = [self._scratch_block] * -(-(n + 1) // bs)  # every position in the one block
        with torch.inference_mode():
            for start, count in ((0, n), (n, 1)):
                batch = ForwardBatch(
                    input_ids=torch.zeros(count, dtype=torch.int64, device=self.device),
                    positions=torch.arange(start, start + count, device=self.device),
                    start_pos=[start],
                    num_tokens=[count],
                    block_tables=[table],
                    sample_index=torch.tensor([count - 1], device=self.device),
                )
                model_forward(model, self, batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def fast_path(self, model: CausalLM, batch: ForwardBatch) -> Callable[[], ForwardOutput] | None:
        # a captured graph ends in logits: hidden rows go through the model's own forward
        if (
            self.graphs is None
            or batch.hidden_index is not None
            or batch.image_rows is not None
            or batch.rope_positions is not None
            or not self.graphs.fits(batch)
        ):
            return None
        return partial(self.graphs.run, batch)

    # ------------------------------------------------------------------ metadata, once per forward

    def prepare(self, batch: ForwardBatch) -> TritonMetadata:
        cache = self.kv_cache
        assert cache is not None, "allocate_kv_cache first"
        bs = cache.block_size
        check_batch(batch, bs)
        split = EntrySplit.of(batch)
        table_rows, slots = table_rows_and_slots(batch, bs, self.device)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)

        def tables(entries: list[int]) -> torch.Tensor:
            return table_rows[entries].to(torch.int32)

        meta = TritonMetadata(
            slots=slots,
            num_tokens=split.num_rows,
            decode_rows=None,
            decode_context=None,
            decode_tables=None,
            max_context=0,
            num_splits=1,
            split_tokens=None,
            prefill_start=None,
            prefill_len=None,
            prefill_prefix=None,
            prefill_tables=None,
            max_prefill_len=0,
        )
        if split.decode_entries:
            contexts = split.decode_contexts
            meta.decode_rows = ints(split.decode_rows)
            meta.decode_context = ints(contexts)
            if split.decode_positions:  # a two-way run's rows read past themselves
                meta.decode_positions = ints(split.decode_positions)
            meta.decode_tables = tables(split.decode_entries)
            meta.max_context = max(contexts)
            meta.num_splits = self.num_splits or fixed_splits(meta.max_context)
            meta.split_tokens = ints([self.split_tokens(meta.max_context, meta.num_splits)])
        if split.prefill_entries:
            meta.prefill_start = ints([row for row, _, _ in split.spans])
            meta.prefill_len = ints([n for _, n, _ in split.spans])
            meta.prefill_prefix = ints([start for _, _, start in split.spans])
            meta.prefill_tables = tables(split.prefill_entries)
            meta.max_prefill_len = max(n for _, n, _ in split.spans)
        return meta

    def split_tokens(self, max_context: int, num_splits: int) -> int:
        """Positions a decode split covers for contexts up to ``max_context``."""
        head_dim = self.config.head_dim
        return self._attention.decode_split_tokens(max_context, num_splits, head_dim)

    # ------------------------------------------------------------------ ops

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise ValueError("the residual must have x's shape and dtype")
        return self._fused.rms_norm(x, weight, eps, residual)

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        if activation in self._fused.ACTIVATIONS:
            return self._fused.gated_activation(gate_up, activation)
        return reference_activation(gate_up, activation, self.config)

    def attention(
        self,
        layer: AttentionLayer,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: object,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        meta: TritonMetadata = metadata  # type: ignore[assignment]
        cache = self.kv_cache
        assert cache is not None
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if qk_norm is not None:
            qkv = _normed_qk(qkv, heads, kv_heads, dim, qk_norm)
        if cache.dtype == torch.float16 and qkv.dtype != torch.float16:
            # as PagedKVCache stores it: an outlier saturates instead of becoming inf
            qkv = qkv.clamp(-FLOAT16_MAX, FLOAT16_MAX)
        k_cache, v_cache = cache.k[layer.index], cache.v[layer.index]
        scales = cache.layer_scales(layer.index)  # int8: read in place, a scale per 32 values
        q = self._fused.rope_kv_store(
            qkv, cos, signed_sin, meta.slots, k_cache, v_cache,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, **scales,
        )  # fmt: skip
        out = torch.empty_like(q)
        common = dict(
            block_size=cache.block_size,
            num_kv_heads=kv_heads,
            scale=layer.scale,
            softcap=layer.softcap,
            window=layer.sliding_window,
            sinks=layer.sinks,
            **scales,
        )
        if meta.decode_rows is not None:
            self._attention.paged_decode_attention(
                q, k_cache, v_cache, out, meta.decode_tables, meta.decode_context,
                meta.decode_rows, max_context=meta.max_context, num_splits=meta.num_splits,
                split_tokens=meta.split_tokens, positions=meta.decode_positions, **common,
            )  # fmt: skip
        if meta.prefill_start is not None:
            self._attention.paged_extend_attention(
                q, k_cache, v_cache, out, meta.prefill_tables, meta.prefill_start,
                meta.prefill_len, meta.prefill_prefix, max_q_len=meta.max_prefill_len, **common,
            )  # fmt: skip
        return out.view(q.shape[0], heads * dim)


def _normed_qk(
    qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, norm: QKNorm
) -> torch.Tensor:
    """qkv with its q and k heads RMS-normed (Qwen3, Gemma 3), before the rope kernel."""
    rows = qkv.shape[0]
    q = F.rms_norm(qkv[:, : heads * dim].view(rows, heads, dim), (dim,), norm.q_weight, norm.eps)
    k_end = (heads + kv_heads) * dim
    k = qkv[:, heads * dim : k_end].view(rows, kv_heads, dim)
    k = F.rms_norm(k, (dim,), norm.k_weight, norm.eps)
    return torch.cat((q.reshape(rows, -1), k.reshape(rows, -1), qkv[:, k_end:]), dim=1)
