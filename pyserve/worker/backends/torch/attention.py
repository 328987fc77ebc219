"""The reference attention over the paged cache, in plain torch on any device: the torch
backend's, and what the CPU kernels backend runs for the layers its kernels do not cover.

For one mixed batch of prefill chunks and decodes:

- Multi-token entries (prefill chunks) go one entry at a time through SDPA: each is large enough
  that the per-entry call is cheap next to its matmuls. A chunk after a cached prefix attends to
  the gathered cached blocks plus its own tokens, causally (a lower-right aligned mask); a
  sliding window cuts the mask to the last W positions of each row.
- Single-token entries (decodes) are batched, without padding every sequence to the longest:
  each request's context is cut into chunks of one length (chosen per batch, see
  ``CHUNK_COST_TOKENS``); the chunks of all requests are gathered into one tensor, scored with one
  batched matmul, and merged per request with a split softmax (max and sum reduced across the
  request's chunks). Padding, and positions outside a layer's window, are masked out.

Soft-capped scores (Gemma 2) and sinks (gpt-oss: a per-head logit in every row's softmax, with no
value) go through an explicit softmax instead of SDPA, which has neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pyserve.worker.backends.base import AttentionLayer, QKNorm
from pyserve.worker.backends.common import EntrySplit, check_batch, table_rows_and_slots
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.rope import apply_rope

# The decode chunk length is chosen per batch to minimise gathered tokens (padding included) plus
# this fixed cost per chunk, in token-equivalents: each chunk is one more small matmul in the
# batch and one more row in the split-softmax bookkeeping. Short contexts thus get one chunk each
# (no split softmax at all), long ones chunks of 128-256 tokens with ~half a chunk of padding.
CHUNK_COST_TOKENS = 32


@dataclass
class PrefillSpan:
    token_start: int  # first of this entry's rows in the batch
    num_tokens: int
    start_pos: int  # cached tokens before the chunk
    blocks: torch.Tensor | None  # int64 ids of the blocks it reads; None: no cached prefix
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window (0: none)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """bool [num_tokens, start_pos + num_tokens]: row i sees positions (start + i - W,
        start + i]; None where plain causal attention over the chunk alone says the same."""
        key = window or 0
        if key in self.masks:
            return self.masks[key]
        n, start = self.num_tokens, self.start_pos
        if start == 0 and (not window or window >= n):
            self.masks[key] = None  # type: ignore[assignment]
            return None
        total = start + n
        rows = torch.arange(n, device=device)[:, None] + start
        cols = torch.arange(total, device=device)[None, :]
        mask = cols <= rows
        if window:
            mask &= cols > rows - window
        self.masks[key] = mask
        return mask


@dataclass
class DecodeChunks:
    token_index: torch.Tensor  # int64 [D]: batch rows of the single-token entries
    chunk_blocks: torch.Tensor  # int64 [C, chunk_blocks]: block ids of each chunk
    chunk_owner: torch.Tensor  # int64 [C]: which of the D rows a chunk belongs to
    chunk_pos: torch.Tensor  # int64 [C, chunk_tokens]: the position each chunk column holds
    context: torch.Tensor  # int64 [D]: positions each row attends to (its own included)
    positions: torch.Tensor  # int64 [D]: each row's own position, where its window ends
    one_chunk_each: bool  # every request fits one chunk: a plain softmax suffices
    biases: dict[int, torch.Tensor] = field(default_factory=dict)  # by window (0: none)

    def bias(self, window: int | None) -> torch.Tensor:
        """float32 [C, chunk_tokens]: 0 where the row attends to the column, -inf elsewhere
        (padding past its context, positions before its window)."""
        key = window or 0
        if key not in self.biases:
            context = self.context[self.chunk_owner][:, None]
            hidden = self.chunk_pos >= context
            if window:
                hidden |= self.chunk_pos <= self.positions[self.chunk_owner][:, None] - window
            bias = torch.zeros(self.chunk_pos.shape, dtype=torch.float32, device=context.device)
            self.biases[key] = bias.masked_fill_(hidden, float("-inf"))
        return self.biases[key]


@dataclass
class TorchAttentionMetadata:
    slots: torch.Tensor  # int64 [T]: cache slot of each new token
    num_tokens: int
    prefills: list[PrefillSpan]
    decode: DecodeChunks | None
    all_decode: bool  # every row is a single-token entry, in order


class ReferenceAttention:
    """Attention over one paged cache, as the module's docstring says."""

    def __init__(self, kv_cache: PagedKVCache, max_chunk_tokens: int | None = None) -> None:
        self.kv_cache = kv_cache
        # a cap on the chosen decode chunk length (tests use it to force the split softmax)
        self.max_chunk_tokens = max_chunk_tokens

    # ------------------------------------------------------------------ metadata, once per forward

    def prepare(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        bs = self.kv_cache.block_size
        check_batch(batch, bs)
        device = self.kv_cache.k[0].device
        table_rows, slots = table_rows_and_slots(batch, bs, device)
        split = EntrySplit.of(batch)
        prefills = [
            self._prefill_span(row, n, start, batch.block_tables[i], device)
            for i, (row, n, start) in zip(split.prefill_entries, split.spans, strict=True)
        ]
        decode = None
        if split.decode_entries:
            decode = self._decode_chunks(split, table_rows)
        return TorchAttentionMetadata(
            slots=slots,
            num_tokens=split.num_rows,
            prefills=prefills,
            decode=decode,
            all_decode=len(split.decode_rows) == split.num_rows,
        )

    def _prefill_span(
        self, row: int, n: int, start: int, table: list[int], device: torch.device
    ) -> PrefillSpan:
        if start == 0:
            return PrefillSpan(row, n, 0, None)
        used = -(-(start + n) // self.kv_cache.block_size)
        return PrefillSpan(
            row, n, start, torch.tensor(table[:used], dtype=torch.int64, device=device)
        )

    def _decode_chunks(self, split: EntrySplit, table_rows: torch.Tensor) -> DecodeChunks:
        device = table_rows.device
        bs = self.kv_cache.block_size
        entries, rows, contexts = split.decode_entries, split.decode_rows, split.decode_contexts
        per_chunk = self._chunk_blocks([-(-c // bs) for c in contexts])
        chunk_tokens = per_chunk * bs
        context = torch.tensor(contexts, device=device)
        positions = context - 1
        if split.decode_positions:
            positions = torch.tensor(split.decode_positions, device=device)
        chunks_each = (context + chunk_tokens - 1) // chunk_tokens
        owner = torch.repeat_interleave(torch.arange(len(entries), device=device), chunks_each)
        first = torch.cumsum(chunks_each, 0) - chunks_each
        chunk_no = torch.arange(owner.numel(), device=device) - first[owner]
        columns = chunk_no[:, None] * per_chunk + torch.arange(per_chunk, device=device)
        columns = columns.clamp_(max=table_rows.shape[1] - 1)  # past a table's end: masked
        entry_idx = torch.tensor(entries, dtype=torch.int64, device=device)
        chunk_blocks = table_rows[entry_idx[owner][:, None], columns]
        pos = chunk_no[:, None] * chunk_tokens + torch.arange(chunk_tokens, device=device)
        return DecodeChunks(
            token_index=torch.tensor(rows, dtype=torch.int64, device=device),
            chunk_blocks=chunk_blocks,
            chunk_owner=owner,
            chunk_pos=pos,
            context=context,
            positions=positions,
            one_chunk_each=owner.numel() == len(entries),
        )

    def _chunk_blocks(self, blocks_needed: list[int]) -> int:
        """Blocks per chunk: the cheapest of the powers of two and the longest context."""
        block_tokens = self.kv_cache.block_size
        longest = max(blocks_needed)
        if self.max_chunk_tokens:
            longest = min(longest, max(1, self.max_chunk_tokens // block_tokens))
        candidates = [longest] + [1 << i for i in range(longest.bit_length()) if 1 << i < longest]

        def cost(per_chunk: int) -> int:
            chunks = sum(-(-n // per_chunk) for n in blocks_needed)
            return chunks * (per_chunk * block_tokens + CHUNK_COST_TOKENS)

        return min(candidates, key=cost)

    # ------------------------------------------------------------------ attention

    def attend_qkv(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """The new tokens' k, v ([T, kv_heads, dim], rotated) into the cache, then attention
        of q [T, heads, dim] → [T, heads, dim]."""
        # k, v as the cache holds them: a prefill chunk attends to exactly what later chunks and
        # decodes read back, so a prompt gives the same result however it is split
        k, v = self.kv_cache.write(layer.index, meta.slots, k, v)
        return self.attend(layer, q, k, v, meta)

    def attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """Attention of the batch's rows, their K/V already in the cache (k, v: as stored)."""
        decode = meta.decode
        if meta.all_decode:
            return self.decode(layer, q, decode)  # type: ignore[arg-type]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for span in meta.prefills:
            rows = slice(span.token_start, span.token_start + span.num_tokens)
            out[rows] = self.prefill(layer, q[rows], k[rows], v[rows], span)
        if decode is not None:
            decoded = self.decode(layer, q.index_select(0, decode.token_index), decode)
            out.index_copy_(0, decode.token_index, decoded)
        return out

    def prefill(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        span: PrefillSpan,
    ) -> torch.Tensor:
        cache = self.kv_cache
        if span.blocks is None:  # nothing cached before this chunk: its own k, v suffice
            keys, values = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        else:
            total = span.start_pos + span.num_tokens
            keys, values = cache.gather(layer.index, span.blocks)
            keys = keys.flatten(1, 2)[:, :total].to(q.dtype)
            values = values.flatten(1, 2)[:, :total].to(q.dtype)
        mask = span.mask(layer.sliding_window, q.device)
        queries = q.transpose(0, 1)  # [heads, rows, dim]
        if layer.softcap is None and layer.sinks is None:
            out = F.scaled_dot_product_attention(
                queries[None],
                keys[None],
                values[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scale,
                enable_gqa=True,
            )[0]
        else:
            if mask is None:  # causal over the chunk alone
                n = q.shape[0]
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            out = _explicit_attention(queries, keys, values, mask, layer)
        return out.transpose(0, 1)

    def decode(self, layer: AttentionLayer, q: torch.Tensor, chunks: DecodeChunks) -> torch.Tensor:
        """q: [D, heads, head_dim] for D single-token entries → the same shape."""
        cache = self.kv_cache
        num_rows = q.shape[0]
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        keys, values = cache.gather(layer.index, chunks.chunk_blocks)  # [KVH, C, nb, bs, dim]
        keys = keys.flatten(2, 3).to(q.dtype)  # [KVH, C, chunk_tokens, dim]
        values = values.flatten(2, 3).to(q.dtype)
        bias = chunks.bias(layer.sliding_window)
        # [D, H, dim] -> [KVH, D, group, dim]: query head h uses kv head h // group
        q_by_kv = (q * layer.scale).view(num_rows, kv_heads, group, dim).transpose(0, 1)
        # each head's sink logit, [KVH, 1, group, 1] as the scores are laid out
        sinks = None if layer.sinks is None else layer.sinks.float().view(kv_heads, 1, group, 1)
        if chunks.one_chunk_each:
            scores = torch.matmul(q_by_kv, keys.transpose(-1, -2))  # [KVH, D, group, tokens]
            scores = _softcap(scores, layer.softcap)
            scores += bias[None, :, None, :]
            if sinks is None:
                probs = torch.softmax(scores, dim=-1)  # accumulates in float32 for bf16 too
            else:
                probs = _softmax_with_sinks(scores, sinks.expand(*scores.shape[:-1], 1))
            out = torch.matmul(probs, values)  # [KVH, D, group, dim]
            return out.transpose(0, 1).reshape(num_rows, layer.num_heads, dim)
        q_by_kv = q_by_kv.index_select(1, chunks.chunk_owner)
        scores = torch.matmul(q_by_kv, keys.transpose(-1, -2)).float()  # [KVH, C, group, tokens]
        scores = _softcap(scores, layer.softcap)
        scores += bias[None, :, None, :]
        # split softmax: each chunk's partial sums are rescaled to its request's running max
        owner = chunks.chunk_owner
        chunk_max = scores.amax(dim=-1)  # [KVH, C, group]
        row_max = torch.full(
            (kv_heads, num_rows, group), float("-inf"), dtype=torch.float32, device=q.device
        )
        row_max.scatter_reduce_(1, owner[None, :, None].expand_as(chunk_max), chunk_max, "amax")
        if sinks is not None:  # the sink is one more column of every row
            row_max = torch.maximum(row_max, sinks[..., 0])
        # a chunk wholly before a window is all -inf: its weights are exp(-inf) = 0
        shift = row_max.index_select(1, owner)[..., None]
        weights = torch.exp(scores - shift)
        denom = torch.zeros_like(row_max).index_add_(1, owner, weights.sum(dim=-1))
        if sinks is not None:
            denom += torch.exp(sinks[..., 0] - row_max)
        partial = torch.matmul(weights.to(values.dtype), values).float()  # [KVH, C, group, dim]
        out = torch.zeros(kv_heads, num_rows, group, dim, dtype=torch.float32, device=q.device)
        out.index_add_(1, owner, partial)
        out = out / denom[..., None]
        return out.to(q.dtype).transpose(0, 1).reshape(num_rows, layer.num_heads, dim)


def split_qkv(
    layer: AttentionLayer,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    qk_norm: QKNorm | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, dim] and k [T, kv_heads, dim], normed and rotated, and v [T, kv_heads,
    dim] from a fused projection."""
    rows, dim, heads = qkv.shape[0], layer.head_dim, layer.num_heads
    qk_size = (heads + layer.num_kv_heads) * dim
    qk = qkv[:, :qk_size].view(rows, -1, dim)
    v = qkv[:, qk_size:].view(rows, layer.num_kv_heads, dim)
    if qk_norm is None:  # q and k heads side by side: one rotation for both
        qk = apply_rope(qk, cos, signed_sin)
        return qk[:, :heads], qk[:, heads:], v
    q = F.rms_norm(qk[:, :heads], (dim,), qk_norm.q_weight, qk_norm.eps)
    k = F.rms_norm(qk[:, heads:], (dim,), qk_norm.k_weight, qk_norm.eps)
    return apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin), v


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] in float32 without the sink's column (as transformers'
    eager attention for gpt-oss): ``sinks`` has the scores' shape but 1 in the last dim."""
    combined = torch.cat([scores.float(), sinks], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1].to(scores.dtype)


def _explicit_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, layer
) -> torch.Tensor:
    """q [heads, rows, dim], keys/values [kv_heads, tokens, dim], mask bool [rows, tokens] →
    [heads, rows, dim]: scaled scores, soft-capped, masked, softmax in float32 with the sinks'
    column where the layer has sinks (as transformers' eager attention for Gemma 2 and
    gpt-oss)."""
    group = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * layer.scale
    scores = _softcap(scores, layer.softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sinks = layer.sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = _softmax_with_sinks(scores, sinks).to(q.dtype)
    return torch.matmul(probs, values)
