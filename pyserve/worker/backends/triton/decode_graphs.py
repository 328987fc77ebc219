"""CUDA graphs of decode steps for the Triton backend: one graph per padded batch size.

A decode step launches a few kernels per layer, each doing little work at small batch sizes,
so the CPU's launch time would bound it. A graph captured once per batch size (1, 2, 4, 8, 16,
then steps of 16 up to the largest) replays all of a step's kernels in one launch. Its inputs
live in static buffers: a step of ``n`` requests fills the first ``n`` rows and replays the
smallest graph with at least ``n``; the padding rows decode token 0 at position 0 into a scratch
block that no request owns (the backend allocates it past the pool), so they never touch a real
request's K/V. A graph replays the launch parameters it was captured with, so the decode
kernel's number of splits is fixed per graph (by the longest context the model serves); the
positions each split covers are read from a device buffer that every step sets from its longest
context, so that a short context is still spread over all the splits.

A step of verify entries (speculative decoding: a request's last token and its drafts, every
position sampled) replays the same graphs: each of its rows is a decode row of the graph at its
own position, attending to its context up to itself (the step writes every row's K/V before any
row attends), so a verify of k drafts is k + 1 rows of a decode graph rather than an eager step.

Without CUDA (``capture=False``) the same static buffers run eagerly: that is how the tests
check the padding on the CPU. An int8 cache's scales are per-layer tensors allocated once with
the cache, like K and V, so a graph captures their addresses as it does theirs.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np
import torch

from pyserve.worker.batch import ForwardBatch

if TYPE_CHECKING:
    from pyserve.worker.backends.triton.backend import TritonBackend, TritonMetadata
    from pyserve.worker.models.decoder import CausalLM


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: TritonBackend,
        *,
        max_batch: int,
        scratch_block: int,
        capture: bool,
    ) -> None:
        from pyserve.worker.backends.triton.backend import TritonMetadata, fixed_splits

        cache = backend.kv_cache
        assert cache is not None
        self.model = model
        self.backend = backend
        self.block_size = cache.block_size
        self.max_blocks = -(-model.config.context_length // self.block_size)
        self.sizes = graph_sizes(max_batch)
        self.scratch_block = scratch_block
        device = backend.device
        size = self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.sample_index = torch.arange(size, dtype=torch.int64, device=device)
        max_context = self.max_blocks * self.block_size
        self.meta = TritonMetadata(
            slots=torch.full((size,), scratch_block * self.block_size, device=device),
            num_tokens=size,
            decode_rows=torch.arange(size, dtype=torch.int32, device=device),
            decode_context=torch.ones(size, dtype=torch.int32, device=device),
            decode_tables=torch.full(
                (size, self.max_blocks), scratch_block, dtype=torch.int32, device=device
            ),
            max_context=max_context,
            num_splits=fixed_splits(max_context),
            split_tokens=torch.ones(1, dtype=torch.int32, device=device),
            prefill_start=None,
            prefill_len=None,
            prefill_prefix=None,
            prefill_tables=None,
            max_prefill_len=0,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps = 0  # decode steps run through the static buffers
        if capture:
            self._capture()

    def _view(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TritonMetadata]:
        meta = dataclasses.replace(
            self.meta,
            slots=self.meta.slots[:size],
            num_tokens=size,
            decode_rows=self.meta.decode_rows[:size],
            decode_context=self.meta.decode_context[:size],
            decode_tables=self.meta.decode_tables[:size],
        )
        return self.input_ids[:size], self.positions[:size], self.sample_index[:size], meta

    def _capture(self) -> None:
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the others reuse its pool
                inputs = self._view(size)
                self.model(*inputs[:3], self.backend, inputs[3])  # warm-up: compiles kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.model(*inputs[:3], self.backend, inputs[3])
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a step a graph can replay: every row samples (decodes and verify
        entries; a prefill chunk samples its last row alone, if any)."""
        rows = len(batch.input_ids)
        return (
            rows <= self.sizes[-1]
            and len(batch.sample_index) == rows
            and not batch.bidirectional
            and all(len(t) <= self.max_blocks for t in batch.block_tables)
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [rows, vocab] of a step that ``fits``."""
        n = len(batch.input_ids)
        size = next(s for s in self.sizes if s >= n)
        self._fill(batch, size)
        self.steps += 1
        graph = self.graphs.get(size)
        if graph is None:  # no CUDA: the same buffers, run eagerly
            with torch.inference_mode():
                inputs = self._view(size)
                return self.model(*inputs[:3], self.backend, inputs[3])[:n]
        graph.replay()
        return self.outputs[size][:n]

    def _fill(self, batch: ForwardBatch, size: int) -> None:
        entries, bs = batch.num_entries, self.block_size
        # Each row is a decode row: an entry's rows (one, or a verify's several) at start_pos,
        # start_pos + 1, .. (host-side: batch.positions may already be on the GPU).
        counts = np.asarray(batch.num_tokens, dtype=np.int64)
        n = int(counts.sum())
        entry = np.repeat(np.arange(entries), counts)  # each row's entry
        positions = np.asarray(batch.start_pos, dtype=np.int64)[entry]
        positions += np.arange(n) - (np.cumsum(counts) - counts)[entry]
        # Only the table columns some row of this step uses are written: the kernel reads a
        # row's table up to its context, a padding row (context 1) its first entry alone.
        lengths = np.fromiter(map(len, batch.block_tables), dtype=np.int64, count=entries)
        width = int(lengths.max())
        entry_tables = np.full((entries, width), self.scratch_block, dtype=np.int32)
        flat = np.fromiter(
            itertools.chain.from_iterable(batch.block_tables), dtype=np.int32, count=lengths.sum()
        )
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        entry_tables[np.repeat(np.arange(entries), lengths), np.arange(len(flat)) - starts] = flat
        tables = np.full((size, width), self.scratch_block, dtype=np.int32)
        tables[:n] = entry_tables[entry]
        slots = np.full(size, self.scratch_block * bs, dtype=np.int64)
        slots[:n] = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        context = np.ones(size, dtype=np.int32)
        context[:n] = positions + 1
        # the split for this step's longest context (the graph's split count is fixed)
        split = self.backend.split_tokens(int(context.max()), self.meta.num_splits)
        self.meta.split_tokens.fill_(split)
        pos = np.zeros(size, dtype=np.int64)
        pos[:n] = positions
        self.input_ids[n:size].zero_()
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        for static, host in (
            (self.positions, pos),
            (self.meta.slots, slots),
            (self.meta.decode_context, context),
        ):
            static[:size].copy_(torch.from_numpy(host), non_blocking=True)
        self.meta.decode_tables[:size, :width].copy_(torch.from_numpy(tables), non_blocking=True)
