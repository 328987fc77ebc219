"""StepExecutor: one Step in, one StepTokens out (request table → model → sampler → table).

Shared by the worker subprocess (process.py) and the in-process OfflineEngine (offline.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch

from pyserve.wire.main_to_worker import NewRequest, Step
from pyserve.wire.worker_to_detok import StepTokens
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.grammar_masks import DraftWalk, GrammarMasks, StepMasks
from pyserve.worker.image_encoder import VisionModel
from pyserve.worker.pooling import attach
from pyserve.worker.sampling import SampleOutput, Sampler
from pyserve.worker.speculative_verify import DraftProposal, VerifyOutput, verify_drafts
from pyserve.worker.state import PreparedStep, RequestState, RequestTable
from pyserve.worker.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from pyserve.worker.draft_model import DraftModel


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
        drafter: DraftModel | None = None,
        vocab_size: int | None = None,
        vision: VisionModel | None = None,
    ) -> None:
        """``vocab_size``: the model's (ids beyond it are an image's); ``vision``: a model that
        takes images (its tower and what its prompts' images need)."""
        if drafter is not None and tp is not None:
            raise ValueError("a draft model cannot run with tensor parallelism (--tp)")
        self.runner = runner
        self.tp = tp  # one rank of a tensor-parallel group: rank 0's tokens are everyone's
        self.drafter = drafter  # drafts worker-drafted verify entries (is_decode 2)
        self.vision = vision
        self.requests = RequestTable(
            block_size=block_size,
            eos_token_ids=eos_token_ids,
            device=device,
            grammars=grammars,
            vocab_size=vocab_size,
            vision=vision,
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
        if prepared.drafted and self.drafter is None:
            raise MalformedStep(
                f"step {step.step_id}: a worker-drafted verify entry, but this worker runs "
                "no draft model"
            )
        out = None
        verified = None
        pooled: dict[int, bytes] = {}
        if prepared.images:
            assert self.vision is not None  # the table refuses images otherwise
            batch = prepared.batch
            batch.image_rows, batch.image_embeds = self.vision.encoder.embeddings(prepared.images)
        if prepared.batch.num_entries:
            masks = None
            table = self.requests
            if prepared.drafted:  # before the masking thread starts: drafting walks grammars too
                self._draft(prepared)
            plain = prepared.sampling
            if prepared.verify:
                plain = [s for j, s in enumerate(plain) if j not in prepared.verify]
            if table.constrained and plain:
                assert table.grammars is not None
                # computed on the masking thread while the forward pass runs
                masks = table.grammars.masks([s.grammar for s in plain])
            with torch.inference_mode():
                hidden = None
                if prepared.batch.hidden_index is not None:
                    logits, hidden = self.runner.forward_hidden(prepared.batch)
                else:
                    logits = self.runner.forward(prepared.batch)
                if prepared.pooling is not None:  # before sampling, which may change logits
                    pooled = prepared.pooling.pool(hidden, logits)
                step_masks = masks.result() if masks is not None else None
                if prepared.verify:
                    out, verified = self._sample_and_verify(logits, prepared, plain, step_masks)
                elif prepared.sampling:
                    out = self.sampler(logits, prepared.sampling, step_masks)
                    if self.tp is not None:
                        out.token_ids = self.tp.broadcast_tokens(out.token_ids)
        forward_ms = (time.perf_counter() - started) * 1e3
        tokens = self.requests.record(prepared, out, forward_ms, verified)
        if pooled:
            attach(tokens, pooled)
        return tokens

    def _sample_and_verify(
        self,
        logits: torch.Tensor,
        prepared: PreparedStep,
        plain: list[RequestState],
        masks: StepMasks | None,
    ) -> tuple[SampleOutput | None, dict[int, VerifyOutput]]:
        """The plain sampling entries' tokens (one row each, in order) and the verify entries'
        results (by sampling entry index); the rows of ``logits`` follow the entries."""
        plain_rows: list[int] = []
        verify_rows: list[int] = []
        row = 0
        for j in range(len(prepared.sampling)):
            drafts = prepared.verify.get(j)
            if drafts is None:
                plain_rows.append(row)
                row += 1
            else:
                verify_rows.extend(range(row, row + 1 + len(drafts)))
                row += 1 + len(drafts)
        out = None
        if plain:
            out = self.sampler(logits[_index(plain_rows, logits)], plain, masks)
        walks: list[DraftWalk] = []
        proposals = []
        probs = {slot.entry: slot.probs for slot in prepared.drafted}
        for j, drafts in prepared.verify.items():  # in entry order, as the rows
            state = prepared.sampling[j]
            walk = self._draft_walk(state, drafts)
            q = probs.get(j)
            if walk is not None:
                walks.append(walk)
                # a grammar rejects a forbidden draft before any test, drawing from the target
                # alone: exact only for drafts taken as point masses (the draft model drafts
                # within the grammar, yet a walk that gets stuck lets any token through)
                q = None
            proposals.append(
                DraftProposal(seq=state, draft_ids=drafts, draft_probs=q, allowed=walk)
            )
        try:
            results = verify_drafts(self.sampler, logits[_index(verify_rows, logits)], proposals)
        finally:
            for walk in walks:  # the real matchers advance by the emitted tokens only
                walk.rollback()
        verified = dict(zip(prepared.verify, results, strict=True))
        if prepared.drafted:
            assert self.drafter is not None
            for slot in prepared.drafted:
                self.drafter.settle(slot, verified[slot.entry].accepted)
        if self.tp is not None:
            out, verified = self._broadcast(out, verified, prepared.verify)
        return out, verified

    def _draft(self, prepared: PreparedStep) -> None:
        """The draft model's drafts for the worker-drafted verify entries, written into the
        batch's input ids and the verify entries' drafts."""
        assert self.drafter is not None
        self.drafter.propose(prepared.drafted, self.requests.grammars)
        input_ids = prepared.batch.input_ids
        for slot in prepared.drafted:
            prepared.verify[slot.entry] = slot.drafts
            input_ids[slot.at : slot.at + slot.k] = torch.tensor(slot.drafts, dtype=torch.int64)

    def _draft_walk(self, state: RequestState, drafts: list[int]) -> DraftWalk | None:
        grammars = self.requests.grammars
        if state.grammar is None or grammars is None:
            return None
        return grammars.draft_walk(state.grammar, drafts)

    def _broadcast(
        self,
        out: SampleOutput | None,
        verified: dict[int, VerifyOutput],
        drafts: dict[int, list[int]],
    ) -> tuple[SampleOutput | None, dict[int, VerifyOutput]]:
        """Rank 0's tokens on every rank. Every rank knows each verify entry's draft count, so
        each gets a fixed slot: the number of tokens emitted, then up to k + 1 tokens."""
        assert self.tp is not None
        flat = list(out.token_ids) if out is not None else []
        for j, result in verified.items():
            slot = [0] * (2 + len(drafts[j]))
            slot[0] = len(result.token_ids)
            slot[1 : 1 + len(result.token_ids)] = result.token_ids
            flat.extend(slot)
        flat = self.tp.broadcast_tokens(flat)
        at = 0
        if out is not None:
            at = len(out.token_ids)
            out.token_ids = flat[:at]
        for j, result in verified.items():
            count = flat[at]
            result.token_ids = flat[at + 1 : at + 1 + count]
            result.accepted = count - 1
            if result.logprobs is not None:  # only rank 0's are sent, but keep lengths right
                result.logprobs = (result.logprobs + [0.0] * count)[:count]
            if result.top_logprobs is not None:
                result.top_logprobs = (result.top_logprobs + [([], [])] * count)[:count]
            at += 2 + len(drafts[j])
        return out, verified


def _index(rows: list[int], logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=logits.device)
