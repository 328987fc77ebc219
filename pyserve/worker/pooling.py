"""Prefill-only requests (NewRequest.pooling): which rows of a step they need, and their vectors.

An embedding or a score is a request with ``max_new_tokens`` 1: the core plans its prompt in one
or more prefill chunks like any other, and its last chunk samples the one token that finishes
it. Besides that token it returns a float32 vector, sent with it in StepTokens.pooled:

- ``last``: the final-norm hidden state of the last prompt token (its last chunk's last row);
- ``mean``: the mean over every prompt position, summed here chunk by chunk (the engine sends it
  with ``match_prefix`` off, so no position comes from the prefix cache uncomputed; a request
  retracted and recomputed starts again at position 0, which restarts the sum);
- ``cls``: the hidden state of position 0 (also computed in full);
- ``logits``: the logits of a few token ids at the last position (a reranker's "yes"/"no").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pyserve.worker.state import RequestState


@dataclass
class PoolingRows:
    """The pooling work of one step."""

    # rows of the step's tokens whose final-norm hidden states are needed, in entry order
    hidden_index: list[int] = field(default_factory=list)
    # (request, its first row in the hidden states, rows, entry starts at position 0, last
    # chunk) for each hidden-pooling entry
    spans: list[tuple[RequestState, int, int, bool, bool]] = field(default_factory=list)
    logits: list[tuple[RequestState, int]] = field(default_factory=list)  # (request, logit row)

    @classmethod
    def of(
        cls,
        states: list[RequestState],
        starts: list[int],
        counts: list[int],
        samples: list[bool] | list[int],
    ) -> PoolingRows | None:
        """The rows that the step's pooling entries need; None when it has none. ``samples``:
        each entry's rows of logits (0 or 1; ``1 + k`` for a verify entry of ``k`` drafts)."""
        rows = cls()
        token = sample_row = 0
        for state, start, n, sample in zip(states, starts, counts, samples, strict=True):
            pooling = state.pooling
            if pooling is not None and not state.finished:
                kind = pooling.kind
                first = len(rows.hidden_index)
                if kind == "mean":
                    rows.hidden_index.extend(range(token, token + n))
                elif kind == "cls" and start == 0:
                    rows.hidden_index.append(token)
                elif kind == "last" and sample:
                    rows.hidden_index.append(token + n - 1)
                elif kind == "logits" and sample:
                    rows.logits.append((state, sample_row))
                taken = len(rows.hidden_index) - first
                if kind != "logits" and (taken or sample):
                    rows.spans.append((state, first, taken, start == 0, sample))
            token += n
            sample_row += sample
        return rows if rows.spans or rows.logits else None

    def hidden_tensor(self, device: torch.device) -> torch.Tensor | None:
        if not self.hidden_index:
            return None
        return torch.tensor(self.hidden_index, dtype=torch.int64, device=device)

    def pool(self, hidden: torch.Tensor | None, logits: torch.Tensor | None) -> dict[int, bytes]:
        """Folds this step's rows into each request's running pool; returns the vectors of the
        requests whose last chunk ran (rid → float32 bytes). Call it before sampling: a
        sampler may change the logits in place."""
        done: dict[int, bytes] = {}
        for state, first, n, restart, last in self.spans:
            assert hidden is not None or n == 0
            if restart:  # a first chunk, or a recompute after a retraction
                state.pool_sum, state.pool_rows = None, 0
            if n:
                rows = hidden[first : first + n].sum(0) if n > 1 else hidden[first]
                state.pool_sum = rows if state.pool_sum is None else state.pool_sum + rows
                state.pool_rows += n
            if last:
                if state.pool_sum is None:
                    raise ValueError(f"request {state.rid}: no hidden state to pool")
                vector = state.pool_sum / max(1, state.pool_rows)
                state.pool_sum, state.pool_rows = None, 0
                done[state.rid] = _float32_bytes(vector)
        if self.logits:
            assert logits is not None
            for state, row in self.logits:
                assert state.pooling is not None
                ids = torch.tensor(state.pooling.token_ids, dtype=torch.int64, device=logits.device)
                done[state.rid] = _float32_bytes(logits[row].index_select(0, ids))
        return done


def _float32_bytes(vector: torch.Tensor) -> bytes:
    return vector.detach().to("cpu", torch.float32).numpy().astype("<f4", copy=False).tobytes()


def attach(tokens: object, pooled: dict[int, bytes]) -> None:
    """Adds the vectors to a StepTokens, at the entries of the requests it reports (a request
    that finished earlier is not reported, and its vector goes nowhere)."""
    from pyserve.wire.worker_to_detok import Pooled

    rids = np.frombuffer(tokens.rids, dtype="<i8").tolist()  # type: ignore[attr-defined]
    tokens.pooled = [  # type: ignore[attr-defined]
        Pooled(index=i, values=pooled[rid]) for i, rid in enumerate(rids) if rid in pooled
    ]
