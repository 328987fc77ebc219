"""One tensor-parallel rank's slices of a checkpoint's tensors (each layer kind declares how it
splits: pyserve/worker/models/layout.py), still read lazily: a rank reads a tensor, keeps its
slice and drops the rest before the next one. A quantized tensor's slice stays in the file's
blocks (rows always; columns where the slice starts and ends on a block), so it packs as the
whole tensor would.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pyserve.worker.loading.base import StoredTensor
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.layout import Split, by_hf_name
from pyserve.worker.models.registry import Family
from pyserve.worker.models.weights import text_model_name
from pyserve.worker.tensor_parallel import vocab_shard

Span = tuple[int, int]


class ShardedTensor(StoredTensor):
    """Rows ``rows`` (spans, one after another) or columns ``cols`` of ``base``, with
    ``pad_rows`` zero rows after them; ``zero``: a tensor of zeros of the base's shape (a
    row-parallel bias, which only rank 0 adds)."""

    def __init__(
        self,
        base: StoredTensor,
        *,
        rows: list[Span] | None = None,
        cols: Span | None = None,
        pad_rows: int = 0,
        zero: bool = False,
    ) -> None:
        self.base, self._rows, self._cols, self._pad, self._zero = base, rows, cols, pad_rows, zero
        self.file, self.name, self.type_name = base.file, base.name, base.type_name
        shape = list(base.shape)
        if rows is not None:
            shape[0] = sum(hi - lo for lo, hi in rows) + pad_rows
        if cols is not None:
            shape[1] = cols[1] - cols[0]
        self.shape = tuple(shape)
        share = math.prod(self.shape) / max(1, math.prod(base.shape))
        self.nbytes = int(base.nbytes * share)

    @property
    def quantized(self) -> bool:
        return self.base.quantized and not self._zero and self._cols_on_blocks()

    @property
    def native_bits(self) -> int | None:
        return self.base.native_bits

    def values(self) -> torch.Tensor:
        full = self.base.values()
        if self._zero:
            return torch.zeros_like(full)
        if self._rows is not None:
            parts = [full[lo:hi] for lo, hi in self._rows]
            if self._pad:
                parts.append(full.new_zeros((self._pad, *full.shape[1:])))
            full = torch.cat(parts)
        if self._cols is not None:
            full = full[:, self._cols[0] : self._cols[1]]
        return full.contiguous()

    def blocks(self) -> np.ndarray | None:
        if self._zero or not self._cols_on_blocks():
            return None
        blocks = self.base.blocks()
        if blocks is None:
            return None
        if self._rows is not None:
            parts = [blocks[lo:hi] for lo, hi in self._rows]
            if self._pad:
                # zero bytes decode to zeros in every GGML type (its scales are zero)
                parts.append(np.zeros((self._pad, blocks.shape[1]), blocks.dtype))
            blocks = np.concatenate(parts)
        if self._cols is not None:
            per_column = blocks.shape[1] / self.base.shape[1]
            lo, hi = self._cols
            blocks = blocks[:, int(lo * per_column) : int(hi * per_column)]
        return np.ascontiguousarray(blocks)

    def _cols_on_blocks(self) -> bool:
        """Whether the column span (if any) starts and ends on the file's block boundaries."""
        if self._cols is None or not self.base.quantized:
            return True
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        width = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]][0]
        return self._cols[0] % width == 0 and self._cols[1] % width == 0


def _split(start: int, total: int, rank: int, size: int) -> Span:
    part = total // size
    return (start + rank * part, start + (rank + 1) * part)


def shard_tensors(
    tensors: list[tuple[str, StoredTensor]],
    config: ModelConfig,
    family: Family,
    rank: int,
    size: int,
) -> list[tuple[str, StoredTensor]]:
    """The slices of ``tensors`` rank ``rank`` of ``size`` holds (names unchanged), split as
    models/layout.py declares; ``config`` is the whole model's."""
    declared = by_hf_name(config, family)
    vocab = config.vocab_size
    rows_per_rank = vocab_shard(vocab, size)
    vocab_lo = min(vocab, rank * rows_per_rank)
    vocab_hi = min(vocab, vocab_lo + rows_per_rank)
    out: list[tuple[str, StoredTensor]] = []
    for raw_name, tensor in tensors:
        t = declared.get(text_model_name(raw_name) or "")
        sharded: StoredTensor = tensor
        if t is None or t.split is Split.REPLICATE:
            pass  # an unknown name fails later, where every tensor is checked against the model
        elif t.split is Split.VOCAB:
            pad = rows_per_rank - (vocab_hi - vocab_lo)
            sharded = ShardedTensor(tensor, rows=[(vocab_lo, vocab_hi)], pad_rows=pad)
        elif t.split is Split.ROWS:
            starts = np.cumsum((0, *t.segments[:-1]))
            spans = [
                _split(int(lo), n, rank, size) for lo, n in zip(starts, t.segments, strict=True)
            ]
            sharded = ShardedTensor(tensor, rows=spans)
        elif t.split is Split.COLUMNS:
            sharded = ShardedTensor(tensor, cols=_split(0, t.segments[0], rank, size))
        elif t.split is Split.RANK0 and rank != 0:
            sharded = ShardedTensor(tensor, zero=True)
        out.append((raw_name, sharded))
    return out
