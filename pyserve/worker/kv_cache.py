"""The paged KV cache: per-layer K and V tensors whose blocks are the core's block ids.

Layout per layer: V is ``[num_kv_heads, num_blocks, block_size, head_dim]`` and K is
``[num_kv_heads, num_blocks, head_dim, block_size]``. Heads come first, so a block is
``block_size * head_dim`` contiguous values per head and gathers move whole blocks. Within a
block K is stored dimension-major: one dimension of the block's tokens is one vector, so the
decode kernel scores a block's tokens against every query head of the group with plain FMAs
(one broadcast query element times one K vector), with no per-token horizontal sums; V stays
token-major, as the weighted sum over tokens reads it (cpp/kernels/attention.h).

An int8 cache (dtype torch.int8) stores K and V as llama.cpp's q8_0 does: each run of
``INT8_GROUP`` (32) values of a token's head (the last run of a head_dim that is not a multiple of
32 shorter) as symmetric int8, ``round(x / s)``, with its float16 scale ``s = max|x| / 127``
beside it. The scales are laid out as their values are, a group in place of 32 dimensions: per
layer ``k_scale`` is ``[num_kv_heads, num_blocks, groups, block_size]`` (dimension-major, as K: a
group's scales of a block's tokens are one vector) and ``v_scale`` is ``[num_kv_heads,
num_blocks, block_size, groups]`` (token-major, as V), addressed by the same block ids. A scale
per 32 values rather than per head follows outlier dimensions (benchmarks/RESULTS.md measures the
drift of both) at the same bytes as a float32 scale per 64-value head: a (token, head) takes
``head_dim + 2 * groups`` bytes against float16's ``2 * head_dim``.
"""

from __future__ import annotations

import numpy as np
import torch

from pyserve.worker.dtypes import KV_INT8_GROUP as INT8_GROUP
from pyserve.worker.dtypes import kv_int8_groups as int8_groups

FLOAT16_MAX = 65504.0
INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] → (int8 values of x's shape, float16 scales [..., groups]): each group
    of INT8_GROUP values symmetric, its scale max|x| / 127 computed in float32 and rounded to
    float16 (within its range); the values divided by that stored scale (multiplied by its
    float32 reciprocal), rounded to nearest even and clamped to ±127. A group of zeros (or one
    whose scale underflows float16) has scale 0 and values 0."""
    dim = x.shape[-1]
    groups = int8_groups(dim)
    x = x.float()
    if groups * INT8_GROUP != dim:
        x = torch.nn.functional.pad(x, (0, groups * INT8_GROUP - dim))
    grouped = x.unflatten(-1, (groups, INT8_GROUP))
    scale = (grouped.abs().amax(dim=-1) / INT8_MAX).clamp_(max=FLOAT16_MAX).to(torch.float16)
    wide = scale.float()
    inverse = torch.where(wide > 0, 1.0 / wide, 0.0)
    q = torch.round(grouped * inverse[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.flatten(-2)[..., :dim].contiguous(), scale  # contiguous: kernels read it whole


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 values [..., head_dim] and their float16 scales [..., groups] → float32."""
    dim = q.shape[-1]
    per_value = scale.float().repeat_interleave(INT8_GROUP, dim=-1)[..., :dim]
    return q.float() * per_value


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU, pages the kernel zeroes when they are first touched (numpy's
    calloc), where torch.zeros writes every byte now: on a small CPU most of a start for a large
    pool, against a little time spread over the first requests that use those blocks."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        k_shape, v_shape = self.shapes()
        # zeros, not empty: masked-out slots are still multiplied (by a zero weight), and
        # uninitialised memory could hold NaN/inf, which 0 * inf would spread.
        self.k = [zeroed(k_shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeroed(v_shape, dtype, device) for _ in range(num_layers)]
        # an int8 cache's float16 scales, a group of a (token, head) each; empty otherwise
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            k_scales, v_scales = self.scale_shapes()
            self.k_scale = [zeroed(k_scales, torch.float16, device) for _ in range(num_layers)]
            self.v_scale = [zeroed(v_scales, torch.float16, device) for _ in range(num_layers)]

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one layer's K and V (a subclass may store another layout)."""
        heads, blocks, size, dim = (
            self.num_kv_heads,
            self.num_blocks,
            self.block_size,
            self.head_dim,
        )
        return (heads, blocks, dim, size), (heads, blocks, size, dim)

    @property
    def scale_groups(self) -> int:
        """An int8 cache's scales per (token, head)."""
        return int8_groups(self.head_dim)

    def scale_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one layer's K and V scales in an int8 cache, laid out as K and V are
        with a group in place of INT8_GROUP dimensions."""
        heads, blocks, size = self.num_kv_heads, self.num_blocks, self.block_size
        groups = self.scale_groups
        return (heads, blocks, groups, size), (heads, blocks, size, groups)

    def layer_scales(self, layer: int) -> dict[str, torch.Tensor]:
        """An int8 cache's K and V scales of ``layer``, as the attention and store kernels'
        ``k_scale`` / ``v_scale`` keywords (none for a float cache)."""
        if not self.quantized:
            return {}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def block_views(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor of the cache (per layer K, then V, then an int8 cache's scales) with
        the axis that indexes blocks: one index along it is one whole block."""
        return [(t, 1) for t in (*self.k, *self.v, *self.k_scale, *self.v_scale)]

    @property
    def nbytes(self) -> int:
        tensors = self.k + self.v + self.k_scale + self.v_scale
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores new tokens' K/V; returns them as stored (the inputs when the dtypes match).

        slots: int64 [T], block * block_size + offset; k, v: [T, kv_heads, head_dim], in any
        float dtype (rounded to the cache's). An int8 cache returns them dequantized, in float32.
        """
        heads = self.num_kv_heads
        if self.quantized:
            return self._write_int8(layer, slots, k, v)
        if k.dtype != self.dtype:
            k, v = self._stored(k), self._stored(v)
        # K: [heads, blocks, dim, block_size]; the two index tensors (block, offset) put the token
        # axis first: k_cache[:, blocks, :, offsets] is [T, heads, dim], as k is
        self.k[layer][:, slots // self.block_size, :, slots % self.block_size] = k
        self.v[layer].view(heads, -1, self.head_dim).index_copy_(1, slots, v.transpose(0, 1))
        return k, v

    def _write_int8(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads, bs = self.num_kv_heads, self.block_size
        (qk, k_scale), (qv, v_scale) = quantize_int8(k), quantize_int8(v)
        blocks, offsets = slots // bs, slots % bs
        self.k[layer][:, blocks, :, offsets] = qk
        self.v[layer].view(heads, -1, self.head_dim).index_copy_(1, slots, qv.transpose(0, 1))
        self.k_scale[layer][:, blocks, :, offsets] = k_scale
        v_scales = self.v_scale[layer].view(heads, -1, self.scale_groups)
        v_scales.index_copy_(1, slots, v_scale.transpose(0, 1))
        return dequantize_int8(qk, k_scale), dequantize_int8(qv, v_scale)

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        """x as the cache holds it: in its dtype, and within float16's range (±65504) for a
        float16 cache, so that an outlier saturates instead of becoming inf (and NaN in
        attention)."""
        if self.dtype == torch.float16 and x.dtype != torch.float16:
            x = x.clamp(-FLOAT16_MAX, FLOAT16_MAX)
        return x.to(self.dtype)

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` (int64, any shape S): each [kv_heads, *S, block_size, head_dim]
        (K transposed back to token-major: a view, for the torch paths' matmuls); an int8 cache's
        dequantized, in float32."""
        # index_select copies whole block rows; advanced indexing (``k[:, blocks]``) is much slower
        flat = blocks.reshape(-1)
        shape = (self.num_kv_heads, *blocks.shape, self.block_size, self.head_dim)
        k = self.k[layer].index_select(1, flat).transpose(-1, -2).reshape(shape)
        v = self.v[layer].index_select(1, flat).view(shape)
        if self.quantized:
            scale_shape = (*shape[:-1], self.scale_groups)
            k_scale = self.k_scale[layer].index_select(1, flat).transpose(-1, -2)
            v_scale = self.v_scale[layer].index_select(1, flat)
            k_scale, v_scale = k_scale.reshape(scale_shape), v_scale.view(scale_shape)
            return dequantize_int8(k, k_scale), dequantize_int8(v, v_scale)
        return k, v


def blocks_for_memory(total: int, free: int, fraction: float, block_bytes: int) -> int:
    """KV blocks that fit in a device's memory so that this process holds at most ``fraction``
    of its ``total`` bytes (SGLang's ``--mem-fraction-static``): what is in use already (the
    weights, the CUDA context, other processes) counts against it; the rest is left for
    activations and graphs."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {fraction}")
    used = total - free
    budget = int(total * fraction) - used
    if budget < block_bytes:
        raise ValueError(
            f"mem_fraction_static={fraction}: {used / 2**30:.1f} of the device's "
            f"{total / 2**30:.1f} GiB are in use already, which leaves no room for a KV cache "
            "(raise it, or give --kv-cache-tokens)"
        )
    return budget // block_bytes
