"""The paged KV cache: per-layer K and V tensors whose blocks are the core's block ids.

Layout per layer: V is ``[num_kv_heads, num_blocks, block_size, head_dim]`` and K is
``[num_kv_heads, num_blocks, head_dim, block_size]``. Heads come first, so a block is
``block_size * head_dim`` contiguous values per head and gathers move whole blocks. Within a
block K is stored dimension-major: one dimension of the block's tokens is one vector, so the
decode kernel scores a block's tokens against every query head of the group with plain FMAs
(one broadcast query element times one K vector), with no per-token horizontal sums; V stays
token-major, as the weighted sum over tokens reads it (cpp/kernels/attention.h).

An int8 cache (dtype torch.int8) stores each token's K and V per kv head as symmetric int8
(round(x / s), s = max|x| / 127) with the float32 scale s beside it: per layer, ``k_scale`` and
``v_scale`` of ``[num_kv_heads, num_blocks, block_size]``, addressed by the same block ids. One
scale per (token, head) rather than per group of 32 (llama.cpp's q8_0): a head's 64-128 values
share one range well enough (benchmarks/RESULTS.md measures the drift), and the kernels read one
scale per token and head. A (token, head) takes ``head_dim + 4`` bytes against float16's
``2 * head_dim``.
"""

from __future__ import annotations

import numpy as np
import torch

FLOAT16_MAX = 65504.0
INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] → (int8 values of x's shape, float32 scales [...]): symmetric, one
    scale per row, max|x| / 127 (0 for an all-zero row, whose values are all 0)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    inverse = torch.where(scale > 0, 1.0 / scale, 0.0)
    q = torch.round(x * inverse[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 values [..., head_dim] and their scales [...] → float32."""
    return q.float() * scale[..., None]


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
        # an int8 cache's scales, per (token, head): [heads, blocks, block_size]; empty otherwise
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            scale_shape = self.scale_shape()
            self.k_scale = [zeroed(scale_shape, torch.float32, device) for _ in range(num_layers)]
            self.v_scale = [zeroed(scale_shape, torch.float32, device) for _ in range(num_layers)]

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

    def scale_shape(self) -> tuple[int, ...]:
        """The shape of one layer's K (and V) scales in an int8 cache."""
        return (self.num_kv_heads, self.num_blocks, self.block_size)

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
        self.k_scale[layer].view(heads, -1).index_copy_(1, slots, k_scale.transpose(0, 1))
        self.v_scale[layer].view(heads, -1).index_copy_(1, slots, v_scale.transpose(0, 1))
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
            scale_shape = shape[:-1]
            k_scale = self.k_scale[layer].index_select(1, flat).view(scale_shape)
            v_scale = self.v_scale[layer].index_select(1, flat).view(scale_shape)
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
