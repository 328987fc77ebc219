"""The torch reference backend: every op in plain torch, on any device; the ground truth the fast
backends are tested against, and the path for what their kernels do not cover.

Attention over the paged cache, for one mixed batch of prefill chunks and decodes:

- Multi-token entries (prefill chunks) go one entry at a time through SDPA: each is large enough
  that the per-entry call is cheap next to its matmuls. A chunk after a cached prefix attends to
  the gathered cached blocks plus its own tokens, causally (a lower-right aligned mask); a
  sliding window cuts the mask to the last W positions of each row.
- Single-token entries (decodes) are batched, without padding every sequence to the longest:
  each request's context is cut into chunks of one length (chosen per batch, see
  ``CHUNK_COST_TOKENS``); the chunks of all requests are gathered into one tensor, scored with one
  batched matmul, and merged per request with a split softmax (max and sum reduced across the
  request's chunks). Padding, and positions outside a layer's window, are masked out.

Soft-capped scores (Gemma 2) go through an explicit softmax instead of SDPA, which has no cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pyserve.worker.backends.base import AttentionLayer, Backend, BackendInfo, QKNorm
from pyserve.worker.batch import ForwardBatch
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
                hidden |= self.chunk_pos < context - window
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


def check_batch(batch: ForwardBatch, block_size: int) -> None:
    num_tokens, start_pos, tables = batch.num_tokens, batch.start_pos, batch.block_tables
    if not num_tokens:
        raise ValueError("ForwardBatch has no entries")
    if not (len(num_tokens) == len(start_pos) == len(tables)):
        raise ValueError("ForwardBatch: num_tokens, start_pos, block_tables differ in length")
    for i, (n, s, table) in enumerate(zip(num_tokens, start_pos, tables, strict=True)):
        if n < 1 or s < 0 or len(table) * block_size < s + n:
            raise ValueError(
                f"ForwardBatch entry {i}: start_pos={s}, num_tokens={n} need "
                f"{-(-(s + n) // block_size)} blocks, the table has {len(table)}"
            )


@dataclass
class EntrySplit:
    """A batch's entries by kind: prefill chunks (several tokens) and decodes (one)."""

    prefill_entries: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # first row, rows, start
    decode_entries: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    num_rows: int = 0

    @classmethod
    def of(cls, batch: ForwardBatch) -> EntrySplit:
        split = cls()
        row = 0
        for i, (n, s) in enumerate(zip(batch.num_tokens, batch.start_pos, strict=True)):
            if n == 1:
                split.decode_entries.append(i)
                split.decode_rows.append(row)
            else:
                split.prefill_entries.append(i)
                split.spans.append((row, n, s))
            row += n
        split.num_rows = row
        return split


def table_rows_and_slots(
    batch: ForwardBatch, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [entries, width] block tables padded with 0, int64 [T] cache slots)."""
    tables = batch.block_tables
    width = max(len(t) for t in tables)
    table_rows = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    table_rows = table_rows.to(device)
    counts = torch.tensor(batch.num_tokens, dtype=torch.int64, device=device)
    entry_of_row = torch.repeat_interleave(torch.arange(len(tables), device=device), counts)
    positions = batch.positions.to(device)
    slots = table_rows[entry_of_row, positions // block_size] * block_size + positions % block_size
    return table_rows, slots


class TorchBackend(Backend):
    name = "torch"

    def __init__(
        self,
        config,
        device: torch.device,
        reason: str = "asked for",
        *,
        max_chunk_tokens: int | None = None,
    ) -> None:
        super().__init__(config, device, reason)
        # a cap on the chosen decode chunk length (tests use it to force the split softmax)
        self.max_chunk_tokens = max_chunk_tokens

    def info(self) -> BackendInfo:
        ops = ("attention", "rms_norm", "gated_activation", "rope_kv", "linear")
        return BackendInfo(self.name, self.reason, dict.fromkeys(ops, "torch"))

    # ------------------------------------------------------------------ metadata, once per forward

    def prepare(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        assert self.kv_cache is not None, "allocate_kv_cache first"
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
            decode = self._decode_chunks(
                split.decode_entries, split.decode_rows, batch.start_pos, table_rows
            )
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
        used = -(-(start + n) // self.kv_cache.block_size)  # type: ignore[union-attr]
        return PrefillSpan(
            row, n, start, torch.tensor(table[:used], dtype=torch.int64, device=device)
        )

    def _decode_chunks(
        self,
        entries: list[int],
        rows: list[int],
        start_pos: list[int],
        table_rows: torch.Tensor,
    ) -> DecodeChunks:
        device = table_rows.device
        bs = self.kv_cache.block_size  # type: ignore[union-attr]
        per_chunk = self._chunk_blocks([-(-(start_pos[e] + 1) // bs) for e in entries])
        chunk_tokens = per_chunk * bs
        context = torch.tensor([start_pos[e] + 1 for e in entries], device=device)
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
            one_chunk_each=owner.numel() == len(entries),
        )

    def _chunk_blocks(self, blocks_needed: list[int]) -> int:
        """Blocks per chunk: the cheapest of the powers of two and the longest context."""
        block_tokens = self.kv_cache.block_size  # type: ignore[union-attr]
        longest = max(blocks_needed)
        if self.max_chunk_tokens:
            longest = min(longest, max(1, self.max_chunk_tokens // block_tokens))
        candidates = [longest] + [1 << i for i in range(longest.bit_length()) if 1 << i < longest]

        def cost(per_chunk: int) -> int:
            chunks = sum(-(-n // per_chunk) for n in blocks_needed)
            return chunks * (per_chunk * block_tokens + CHUNK_COST_TOKENS)

        return min(candidates, key=cost)

    # ------------------------------------------------------------------ ops

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError("the residual must have x's shape and dtype")
            x = residual.add_(x)
        return F.rms_norm(x, weight.shape, weight, eps)

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if activation == "silu":
            return F.silu(gate) * up
        if activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        raise ValueError(f"activation {activation!r} is not supported")

    def split_qkv(
        self,
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

    def attention(self, layer, qkv, cos, signed_sin, metadata, qk_norm=None):
        q, k, v = self.split_qkv(layer, qkv, cos, signed_sin, qk_norm)
        return self.attend_qkv(layer, q, k, v, metadata).reshape(q.shape[0], -1)

    def attend_qkv(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """The new tokens' k, v ([T, kv_heads, dim], rotated) into the cache, then attention
        of q [T, heads, dim] → [T, heads, dim]."""
        meta: TorchAttentionMetadata = metadata  # type: ignore[assignment]
        # k, v as the cache holds them: a prefill chunk attends to exactly what later chunks and
        # decodes read back, so a prompt gives the same result however it is split
        k, v = self.kv_cache.write(layer.index, meta.slots, k, v)  # type: ignore[union-attr]
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
            return self._decode(layer, q, decode)  # type: ignore[arg-type]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for span in meta.prefills:
            rows = slice(span.token_start, span.token_start + span.num_tokens)
            out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], span)
        if decode is not None:
            decoded = self._decode(layer, q.index_select(0, decode.token_index), decode)
            out.index_copy_(0, decode.token_index, decoded)
        return out

    def _prefill(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        span: PrefillSpan,
    ) -> torch.Tensor:
        cache = self.kv_cache
        assert cache is not None
        if span.blocks is None:  # nothing cached before this chunk: its own k, v suffice
            keys, values = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        else:
            total = span.start_pos + span.num_tokens
            keys, values = cache.gather(layer.index, span.blocks)
            keys = keys.flatten(1, 2)[:, :total].to(q.dtype)
            values = values.flatten(1, 2)[:, :total].to(q.dtype)
        mask = span.mask(layer.sliding_window, q.device)
        queries = q.transpose(0, 1)  # [heads, rows, dim]
        if layer.softcap is None:
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
            out = _softcapped_attention(queries, keys, values, mask, layer)
        return out.transpose(0, 1)

    def _decode(self, layer: AttentionLayer, q: torch.Tensor, chunks: DecodeChunks) -> torch.Tensor:
        """q: [D, heads, head_dim] for D single-token entries → the same shape."""
        cache = self.kv_cache
        assert cache is not None
        num_rows = q.shape[0]
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        keys, values = cache.gather(layer.index, chunks.chunk_blocks)  # [KVH, C, nb, bs, dim]
        keys = keys.flatten(2, 3).to(q.dtype)  # [KVH, C, chunk_tokens, dim]
        values = values.flatten(2, 3).to(q.dtype)
        bias = chunks.bias(layer.sliding_window)
        # [D, H, dim] -> [KVH, D, group, dim]: query head h uses kv head h // group
        q_by_kv = (q * layer.scale).view(num_rows, kv_heads, group, dim).transpose(0, 1)
        if chunks.one_chunk_each:
            scores = torch.matmul(q_by_kv, keys.transpose(-1, -2))  # [KVH, D, group, tokens]
            scores = _softcap(scores, layer.softcap)
            scores += bias[None, :, None, :]
            probs = torch.softmax(scores, dim=-1)  # accumulates in float32 for bf16 too
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
        # a chunk wholly before a window is all -inf: its weights are exp(-inf) = 0
        shift = row_max.index_select(1, owner)[..., None]
        weights = torch.exp(scores - shift)
        denom = torch.zeros_like(row_max).index_add_(1, owner, weights.sum(dim=-1))
        partial = torch.matmul(weights.to(values.dtype), values).float()  # [KVH, C, group, dim]
        out = torch.zeros(kv_heads, num_rows, group, dim, dtype=torch.float32, device=q.device)
        out.index_add_(1, owner, partial)
        out = out / denom[..., None]
        return out.to(q.dtype).transpose(0, 1).reshape(num_rows, layer.num_heads, dim)


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, layer
) -> torch.Tensor:
    """q [heads, rows, dim], keys/values [kv_heads, tokens, dim], mask bool [rows, tokens] →
    [heads, rows, dim]: scaled scores, soft-capped, masked, softmax in float32 (as transformers'
    eager attention for Gemma 2)."""
    group = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * layer.scale
    scores = _softcap(scores, layer.softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)
