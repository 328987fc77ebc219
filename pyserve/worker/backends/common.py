"""What every backend's per-forward metadata starts from: the batch checked, its entries split by
kind (prefill chunks, decodes), its block tables as one tensor and the cache slot of each new
token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyserve.worker.batch import ForwardBatch


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
    """A batch's rows by how their attention runs: prefill spans (an entry's tokens together) and
    decode rows (one token each, attending to its own context)."""

    prefill_entries: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # first row, rows, start
    decode_entries: list[int] = field(default_factory=list)  # per decode row: its entry
    decode_rows: list[int] = field(default_factory=list)
    decode_contexts: list[int] = field(default_factory=list)  # per decode row: keys it reads
    # per decode row: its own position, where a sliding window ends (context - 1 but in a
    # bidirectional run, whose rows read past themselves); empty: context - 1 everywhere
    decode_positions: list[int] = field(default_factory=list)
    num_rows: int = 0

    @classmethod
    def of(cls, batch: ForwardBatch, decode_rows_up_to: int = 1) -> EntrySplit:
        """Decodes are decode rows; so is each row of a continuing entry (start_pos > 0) of at
        most ``decode_rows_up_to`` tokens, such as a verify entry's drafts, where a backend's
        decode attention beats its prefill attention on a few queries over a long context (every
        row's K/V is written before any row attends). A bidirectional run of rows
        (``batch.bidirectional``) is decode rows that each read to the run's end; the entry's
        rows around it stay spans."""
        split = cls()
        runs: dict[int, list[tuple[int, int]]] = {}
        for entry, offset, rows in batch.bidirectional:
            runs.setdefault(entry, []).append((offset, rows))
        row = 0
        for i, (n, s) in enumerate(zip(batch.num_tokens, batch.start_pos, strict=True)):
            if i in runs:
                split._add_with_runs(i, row, n, s, runs[i])
            elif n == 1 or (n <= decode_rows_up_to and s > 0):
                split.decode_entries.extend([i] * n)
                split.decode_rows.extend(range(row, row + n))
                split.decode_contexts.extend(range(s + 1, s + n + 1))
                if runs:
                    split.decode_positions.extend(range(s, s + n))
            else:
                split.prefill_entries.append(i)
                split.spans.append((row, n, s))
            row += n
        split.num_rows = row
        return split

    def _add_with_runs(
        self, entry: int, row: int, n: int, start: int, runs: list[tuple[int, int]]
    ) -> None:
        at = 0
        for offset, rows in sorted(runs):
            if offset > at:  # the causal rows before the run
                self.prefill_entries.append(entry)
                self.spans.append((row + at, offset - at, start + at))
            end = start + offset + rows  # every row of the run reads to its end
            self.decode_entries.extend([entry] * rows)
            self.decode_rows.extend(range(row + offset, row + offset + rows))
            self.decode_contexts.extend([end] * rows)
            self.decode_positions.extend(range(start + offset, end))
            at = offset + rows
        if at < n:
            self.prefill_entries.append(entry)
            self.spans.append((row + at, n - at, start + at))


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
