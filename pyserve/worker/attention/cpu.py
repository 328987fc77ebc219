"""CPU attention: one mixed batch of prefill chunks and decodes, gather by block table + matmul.

Two paths run inside the same forward:

- Multi-token entries (prefill chunks) go one entry at a time through SDPA: each is large enough
  that the per-entry call is cheap next to its matmuls. A chunk after a cached prefix attends to
  the gathered cached blocks plus its own tokens, causally (a lower-right aligned mask).
- Single-token entries (decodes) are batched, without padding every sequence to the longest:
  each request's context is cut into chunks of one length (chosen per batch, see
  ``CHUNK_COST_TOKENS``); the chunks of all requests are gathered into one tensor, scored with one
  batched matmul, and merged per request with a split softmax (max and sum reduced across the
  request's chunks). Padding is less than one chunk per request, masked out.

On the CPU both go instead through the fused C++ kernels (attention_kernel.py), which read K and V
in place from the cache through each request's block table, with no gather copy and one pass of
online softmax: all prefill chunks of the batch in one call, then all decodes in another. The
prefill kernel is used where its AVX-512 loops run (its portable loops are the reference, slower
than SDPA). ``PYSERVE_ATTENTION=torch`` (or ``decode_kernel=False``) keeps the torch paths above,
which are also the paths for other devices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyserve.worker import layer_ops, quant
from pyserve.worker.attention.base import AttentionBackend
from pyserve.worker.attention_kernel import (
    DTYPE_CODES,
    DecodeAttention,
    PrefillAttention,
    kernel_available,
)
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import PagedKVCache

# The decode chunk length is chosen per batch to minimise gathered tokens (padding included) plus
# this fixed cost per chunk, in token-equivalents: each chunk is one more small matmul in the
# batch and one more row in the split-softmax bookkeeping. Short contexts thus get one chunk each
# (no split softmax at all), long ones chunks of 128-256 tokens with ~half a chunk of padding.
CHUNK_COST_TOKENS = 32
# "kernel" (the default where it can run) or "torch": how decode tokens attend on the CPU
ATTENTION_ENV = "PYSERVE_ATTENTION"


@dataclass
class PrefillSpan:
    token_start: int  # first of this entry's rows in the batch
    num_tokens: int
    start_pos: int  # cached tokens before the chunk
    blocks: torch.Tensor | None  # int64 ids of the blocks it reads; None: no cached prefix
    mask: torch.Tensor | None  # bool [num_tokens, start_pos + num_tokens], lower-right causal


@dataclass
class DecodeChunks:
    token_index: torch.Tensor  # int64 [D]: batch rows of the single-token entries
    chunk_blocks: torch.Tensor  # int64 [C, chunk_blocks]: block ids of each chunk
    chunk_owner: torch.Tensor  # int64 [C]: which of the D rows a chunk belongs to
    chunk_bias: torch.Tensor  # [C, chunk_tokens], cache dtype: 0 for a real position, -inf pad
    one_chunk_each: bool  # every request fits one chunk: a plain softmax suffices


@dataclass
class DecodeKernelBatch:
    token_index: torch.Tensor  # int64 [D]: batch rows of the single-token entries
    call: DecodeAttention  # their block tables and context lengths, checked once per forward


@dataclass
class CpuAttentionMetadata:
    slots: torch.Tensor  # int64 [T]: cache slot of each new token
    num_tokens: int
    prefills: list[PrefillSpan] | PrefillAttention  # the kernel's call for all of them
    decode: DecodeChunks | DecodeKernelBatch | None
    all_decode: bool  # every row is a single-token entry, in order


class CpuAttentionBackend(AttentionBackend):
    def __init__(
        self,
        kv_cache: PagedKVCache,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_chunk_tokens: int | None = None,
        decode_kernel: bool | None = None,
    ):
        super().__init__(
            kv_cache, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        self.decode_kernel = self._use_decode_kernel(decode_kernel)
        self.prefill_kernel = self.decode_kernel and quant.kernels().isa() == "avx512_vnni"
        # a cap on the chosen chunk length (tests use it to force the split-softmax path)
        self.max_chunk_blocks = (
            max(1, max_chunk_tokens // kv_cache.block_size) if max_chunk_tokens else None
        )

    def _use_decode_kernel(self, requested: bool | None) -> bool:
        """The kernel unless asked otherwise (argument, then env), where the cache can use it."""
        if requested is None:
            choice = os.environ.get(ATTENTION_ENV, "kernel")
            if choice not in ("kernel", "torch"):
                raise ValueError(f"{ATTENTION_ENV}={choice!r}: expected 'kernel' or 'torch'")
            requested = choice == "kernel"
        cache = self.kv_cache.k[0]
        usable = cache.device.type == "cpu" and cache.dtype in DTYPE_CODES
        return requested and usable and kernel_available()

    # ------------------------------------------------------------------ metadata, once per forward

    def prepare(self, batch: ForwardBatch) -> CpuAttentionMetadata:
        bs = self.kv_cache.block_size
        device = self.kv_cache.k[0].device
        num_tokens, start_pos, tables = batch.num_tokens, batch.start_pos, batch.block_tables
        if not num_tokens:
            raise ValueError("ForwardBatch has no entries")
        if not (len(num_tokens) == len(start_pos) == len(tables)):
            raise ValueError("ForwardBatch: num_tokens, start_pos, block_tables differ in length")
        for i, (n, s, table) in enumerate(zip(num_tokens, start_pos, tables, strict=True)):
            if n < 1 or s < 0 or len(table) * bs < s + n:
                raise ValueError(
                    f"ForwardBatch entry {i}: start_pos={s}, num_tokens={n} need "
                    f"{-(-(s + n) // bs)} blocks, the table has {len(table)}"
                )
        width = max(len(t) for t in tables)
        table_rows = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        table_rows = table_rows.to(device)
        counts = torch.tensor(num_tokens, dtype=torch.int64, device=device)
        entry_of_row = torch.repeat_interleave(torch.arange(len(tables), device=device), counts)
        positions = batch.positions.to(device)
        slots = table_rows[entry_of_row, positions // bs] * bs + positions % bs

        prefills: list[PrefillSpan] = []
        prefill_entries: list[int] = []
        spans: list[tuple[int, int, int]] = []  # the kernel's: first row, rows, start
        decode_entries: list[int] = []
        decode_rows: list[int] = []
        row = 0
        for i, (n, s) in enumerate(zip(num_tokens, start_pos, strict=True)):
            if n == 1:
                decode_entries.append(i)
                decode_rows.append(row)
            elif self.prefill_kernel:
                prefill_entries.append(i)
                spans.append((row, n, s))
            else:
                prefills.append(self._prefill_span(row, n, s, tables[i], device))
            row += n
        prefill: list[PrefillSpan] | PrefillAttention = prefills
        if spans:
            prefill = PrefillAttention(
                torch.tensor(spans, dtype=torch.int64),
                table_rows[prefill_entries],
                num_rows=row,
                num_heads=self.num_heads,
                k_cache=self.kv_cache.k[0],
            )
        decode: DecodeChunks | DecodeKernelBatch | None = None
        if decode_entries and self.decode_kernel:
            decode = self._decode_kernel_batch(decode_entries, decode_rows, start_pos, table_rows)
        elif decode_entries:
            decode = self._decode_chunks(decode_entries, decode_rows, start_pos, table_rows)
        return CpuAttentionMetadata(
            slots=slots,
            num_tokens=row,
            prefills=prefill,
            decode=decode,
            all_decode=len(decode_rows) == row,
        )

    def _prefill_span(
        self, row: int, n: int, start: int, table: list[int], device: torch.device
    ) -> PrefillSpan:
        if start == 0:
            return PrefillSpan(row, n, 0, None, None)
        total = start + n
        used = -(-total // self.kv_cache.block_size)
        blocks = torch.tensor(table[:used], dtype=torch.int64, device=device)
        mask = torch.ones(n, total, dtype=torch.bool, device=device).tril(diagonal=start)
        return PrefillSpan(row, n, start, blocks, mask)

    def _decode_kernel_batch(
        self,
        entries: list[int],
        rows: list[int],
        start_pos: list[int],
        table_rows: torch.Tensor,
    ) -> DecodeKernelBatch:
        tables = table_rows if len(entries) == len(table_rows) else table_rows[entries]
        contexts = torch.tensor([start_pos[e] + 1 for e in entries], dtype=torch.int64)
        call = DecodeAttention(
            tables, contexts, num_heads=self.num_heads, k_cache=self.kv_cache.k[0]
        )
        return DecodeKernelBatch(torch.tensor(rows, dtype=torch.int64), call)

    def _decode_chunks(
        self,
        entries: list[int],
        rows: list[int],
        start_pos: list[int],
        table_rows: torch.Tensor,
    ) -> DecodeChunks:
        device = table_rows.device
        bs = self.kv_cache.block_size
        per_chunk = self._chunk_blocks([-(-(start_pos[e] + 1) // bs) for e in entries])
        chunk_tokens = per_chunk * bs
        context = torch.tensor([start_pos[e] + 1 for e in entries], device=device)
        chunks_each = (context + chunk_tokens - 1) // chunk_tokens
        owner = torch.repeat_interleave(torch.arange(len(entries), device=device), chunks_each)
        first = torch.cumsum(chunks_each, 0) - chunks_each
        chunk_no = torch.arange(owner.numel(), device=device) - first[owner]
        columns = chunk_no[:, None] * per_chunk + torch.arange(per_chunk, device=device)
        columns = columns.clamp_(max=table_rows.shape[1] - 1)  # past a table's end: masked below
        entry_idx = torch.tensor(entries, dtype=torch.int64, device=device)
        chunk_blocks = table_rows[entry_idx[owner][:, None], columns]
        pos = chunk_no[:, None] * chunk_tokens + torch.arange(chunk_tokens, device=device)
        # float32 adds into scores of any dtype in place (bf16 included)
        bias = torch.zeros(pos.shape, dtype=torch.float32, device=device)
        bias.masked_fill_(pos >= context[owner][:, None], float("-inf"))
        return DecodeChunks(
            token_index=torch.tensor(rows, dtype=torch.int64, device=device),
            chunk_blocks=chunk_blocks,
            chunk_owner=owner,
            chunk_bias=bias,
            one_chunk_each=owner.numel() == len(entries),
        )

    def _chunk_blocks(self, blocks_needed: list[int]) -> int:
        """Blocks per chunk: the cheapest of the powers of two and the longest context."""
        longest = max(blocks_needed)
        if self.max_chunk_blocks is not None:
            longest = min(longest, self.max_chunk_blocks)
        candidates = [longest] + [1 << i for i in range(longest.bit_length()) if 1 << i < longest]
        block_tokens = self.kv_cache.block_size

        def cost(per_chunk: int) -> int:
            chunks = sum(-(-n // per_chunk) for n in blocks_needed)
            return chunks * (per_chunk * block_tokens + CHUNK_COST_TOKENS)

        return min(candidates, key=cost)

    # ------------------------------------------------------------------ per layer

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        meta: CpuAttentionMetadata = metadata  # type: ignore[assignment]
        # k, v as the cache holds them: a prefill chunk attends to exactly what later chunks and
        # decodes read back, so a prompt gives the same result however it is split
        k, v = self.kv_cache.write(layer, meta.slots, k, v)
        return self._attend(layer, q, k, v, meta)

    def forward_qkv(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """With both kernels in use, one C++ pass rotates q and k and writes k, v into the cache
        (layer_ops.rope_write_kv); the kernels then read every K/V from the cache."""
        meta: CpuAttentionMetadata = metadata  # type: ignore[assignment]
        if self.prefill_kernel and layer_ops.rope_write_kv(
            qkv,
            cos,
            signed_sin,
            meta.slots,
            self.kv_cache.k[layer],
            self.kv_cache.v[layer],
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
        ):
            q = qkv[:, : self.num_heads * self.head_dim].view(-1, self.num_heads, self.head_dim)
            return self._attend(layer, q, None, None, meta)
        return super().forward_qkv(layer, qkv, cos, signed_sin, metadata)

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: CpuAttentionMetadata,
    ) -> torch.Tensor:
        """Attention of the batch's rows, their K/V already in the cache (k, v: as stored, for
        the torch prefill path; None when the kernels read everything from the cache)."""
        decode = meta.decode
        if meta.all_decode:
            return self._attend_decodes(layer, q, decode)  # type: ignore[arg-type]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if isinstance(meta.prefills, PrefillAttention):
            k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]
            meta.prefills.run(q, k_cache, v_cache, self.scale, out)
        else:
            for span in meta.prefills:
                rows = slice(span.token_start, span.token_start + span.num_tokens)
                out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], span)
        if decode is not None:
            decoded = self._attend_decodes(layer, q.index_select(0, decode.token_index), decode)
            out.index_copy_(0, decode.token_index, decoded)
        return out

    def _attend_decodes(
        self, layer: int, q: torch.Tensor, decode: DecodeChunks | DecodeKernelBatch
    ) -> torch.Tensor:
        """q: [D, heads, head_dim] of the single-token entries → their attention output."""
        if isinstance(decode, DecodeKernelBatch):
            k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]
            return decode.call.run(q, k_cache, v_cache, self.scale)
        return self._decode(layer, q, decode)

    def _prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        if span.blocks is None:  # nothing cached before this chunk: its own k, v suffice
            keys, values = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
            mask, causal = None, True
        else:
            total = span.start_pos + span.num_tokens
            keys, values = self.kv_cache.gather(layer, span.blocks)
            keys = keys.flatten(1, 2)[:, :total].to(q.dtype)
            values = values.flatten(1, 2)[:, :total].to(q.dtype)
            mask, causal = span.mask, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _decode(self, layer: int, q: torch.Tensor, chunks: DecodeChunks) -> torch.Tensor:
        """q: [D, heads, head_dim] for D single-token entries → the same shape."""
        num_rows = q.shape[0]
        kv_heads, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        keys, values = self.kv_cache.gather(layer, chunks.chunk_blocks)  # [KVH, C, nb, bs, dim]
        keys = keys.flatten(2, 3).to(q.dtype)  # [KVH, C, chunk_tokens, dim]
        values = values.flatten(2, 3).to(q.dtype)
        # [D, H, dim] -> [KVH, D, group, dim]: query head h uses kv head h // group
        q_by_kv = (q * self.scale).view(num_rows, kv_heads, group, dim).transpose(0, 1)
        if chunks.one_chunk_each:
            scores = torch.matmul(q_by_kv, keys.transpose(-1, -2))  # [KVH, D, group, tokens]
            scores += chunks.chunk_bias[None, :, None, :]
            probs = torch.softmax(scores, dim=-1)  # accumulates in float32 for bf16 too
            out = torch.matmul(probs, values)  # [KVH, D, group, dim]
            return out.transpose(0, 1).reshape(num_rows, self.num_heads, dim)
        q_by_kv = q_by_kv.index_select(1, chunks.chunk_owner)
        scores = torch.matmul(q_by_kv, keys.transpose(-1, -2)).float()  # [KVH, C, group, tokens]
        scores += chunks.chunk_bias[None, :, None, :]
        # split softmax: each chunk's partial sums are rescaled to its request's running max
        owner = chunks.chunk_owner
        chunk_max = scores.amax(dim=-1)  # [KVH, C, group]
        row_max = torch.full(
            (kv_heads, num_rows, group), float("-inf"), dtype=torch.float32, device=q.device
        )
        row_max.scatter_reduce_(1, owner[None, :, None].expand_as(chunk_max), chunk_max, "amax")
        weights = torch.exp(scores - row_max.index_select(1, owner)[..., None])
        denom = torch.zeros_like(row_max).index_add_(1, owner, weights.sum(dim=-1))
        partial = torch.matmul(weights.to(values.dtype), values).float()  # [KVH, C, group, dim]
        out = torch.zeros(kv_heads, num_rows, group, dim, dtype=torch.float32, device=q.device)
        out.index_add_(1, owner, partial)
        out = out / denom[..., None]
        return out.to(q.dtype).transpose(0, 1).reshape(num_rows, self.num_heads, dim)
