"""StepExecutor: one Step in, one StepTokens out (request table → model → sampler → table).

Shared by the worker subprocess (process.py) and the in-process OfflineEngine (offline.py).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from pyserve.wire.main_to_worker import NewRequest, Step
from pyserve.wire.worker_to_detok import StepTokens
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.grammar_masks import GrammarMasks
from pyserve.worker.pooling import attach
from pyserve.worker.sampling import Sampler
from pyserve.worker.state import RequestState, RequestTable
from pyserve.worker.tensor_parallel import TensorParallel


class MalformedStep(ValueError):
    """A step the request table refused, before the model ran."""


class Runner(Protocol):
    """The part of ModelRunner the executor uses."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def forward_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


class StepExecutor:
    def __init__(
        self,
        runner: Runner,
        *,
        block_size: int,
        eos_token_ids: list[int],
        device: torch.device | str = "cpu",
        seed: int | None = None,
        grammars: GrammarMasks | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        self.runner = runner
        self.tp = tp  # one rank of a tensor-parallel group: rank 0's tokens are everyone's
        self.requests = RequestTable(
            block_size=block_size, eos_token_ids=eos_token_ids, device=device, grammars=grammars
        )
        self.sampler = Sampler(eos_token_ids, device=device, seed=seed)

    def add_request(self, request: NewRequest) -> RequestState:
        return self.requests.add(request)

    def execute(self, step: Step) -> StepTokens:
        """Runs the forward pass and sampling of ``step``; raises on a malformed step."""
        started = time.perf_counter()
        try:
            prepared = self.requests.prepare(step)
        except Exception as e:  # before any collective: every rank refuses the step alike
            raise MalformedStep(str(e)) from e
        out = None
        pooled: dict[int, bytes] = {}
        if prepared.batch.num_entries:
            masks = None
            table = self.requests
            if table.constrained and prepared.sampling:
                assert table.grammars is not None
                # computed on the masking thread while the forward pass runs
                masks = table.grammars.masks([s.grammar for s in prepared.sampling])
            with torch.inference_mode():
                hidden = None
                if prepared.batch.hidden_index is not None:
                    logits, hidden = self.runner.forward_hidden(prepared.batch)
                else:
                    logits = self.runner.forward(prepared.batch)
                if prepared.pooling is not None:  # before sampling, which may change logits
                    pooled = prepared.pooling.pool(hidden, logits)
                if prepared.sampling:
                    out = self.sampler(
                        logits, prepared.sampling, masks.result() if masks is not None else None
                    )
                    if self.tp is not None:
                        out.token_ids = self.tp.broadcast_tokens(out.token_ids)
        forward_ms = (time.perf_counter() - started) * 1e3
        tokens = self.requests.record(prepared, out, forward_ms)
        if pooled:
            attach(tokens, pooled)
        return tokens
