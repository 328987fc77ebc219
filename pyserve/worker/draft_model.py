"""The draft model: a second, smaller model in the worker that drafts tokens for worker-drafted
verify entries (``Step.is_decode == 2``), which speculative_verify.py then verifies exactly.

The draft model has a paged KV pool of its own, of the target's ``num_blocks`` blocks, indexed by
the same block ids: a Step's block tables serve both models. Each request tracks
``draft_computed``, the leading positions whose K/V in the draft pool are valid. For a verify
entry of ``k`` drafts starting at the request's last sampled token (position ``start``), the draft
model first catches up: one forward pass over the request's known tokens from ``draft_computed``
through ``start`` (for a fresh request, its whole prompt: a prefill chunk in the draft pool); then
``k - 1`` single-token steps, every drafting request of the Step batched in each. A request with
fewer drafts drops out of the later steps.

Catching up from position 0 is safe even where the request's first blocks are shared with other
requests through the prefix cache: a shared block holds the same tokens at the same positions for
every request that shares it, so the K/V written there are the values any of them would write
(up to rounding, which only changes which tokens are proposed, never what verification emits).

Greedy requests take the draft model's argmax. Sampled requests draw from its softmax at the
request's temperature and record that distribution (``q``) for rejection sampling. The draws use a
generator of the draft model's (per request when the request is seeded, so that its output does
not depend on its neighbours), never the request's own, which feeds verification alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import torch

from pyserve.worker.batch import ForwardBatch
from pyserve.worker.sampling import is_greedy
from pyserve.worker.settings import WorkerSettings
from pyserve.worker.state import DraftSlot, RequestState

if TYPE_CHECKING:
    from pyserve.worker.executor import Runner
    from pyserve.worker.grammar_masks import DraftWalk, GrammarMasks
    from pyserve.worker.model_runner import ModelRunner

# mixed into a seeded request's seed for its draft generator, so that the draft model's draws
# and the request's own verification draws are not the same stream
_DRAFT_SEED_SALT = 0x5DEECE66D


def load_draft_runner(settings: WorkerSettings, target: ModelRunner) -> ModelRunner:
    """The ModelRunner of ``settings.draft_model``, beside ``target`` (a ModelRunner): the same
    device, dtype, quantization, KV dtype and block size, and the target's ``num_blocks``.

    Raises ValueError in one line when the two vocabularies differ, or when the draft model holds
    fewer positions than the target serves."""
    from pyserve.worker.loading import open_checkpoint
    from pyserve.worker.model_runner import ModelRunner

    assert settings.draft_model is not None
    target_config = target.config
    draft_config = open_checkpoint(settings.draft_model).config
    target_name = settings.model or "(default)"
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft model {settings.draft_model} has a vocabulary of "
            f"{draft_config.vocab_size} tokens and the model {target_name} one of "
            f"{target_config.vocab_size}: a draft model must share the model's vocabulary"
        )
    max_model_len = target.max_model_len
    if draft_config.context_length < max_model_len:
        raise ValueError(
            f"the draft model {settings.draft_model} holds {draft_config.context_length} "
            f"positions, fewer than the {max_model_len} the model {target_name} serves: "
            "lower max_model_len"
        )
    draft_settings = msgspec.structs.replace(
        settings,
        model=settings.draft_model,
        draft_model=None,
        num_blocks=target.num_blocks,
        mem_fraction_static=None,  # the pool's size is the target's, whatever memory is left
        max_model_len=max_model_len,
    )
    return ModelRunner(draft_settings)


class DraftModel:
    """Proposes the drafts of a Step's worker-drafted verify entries."""

    def __init__(
        self,
        runner: Runner,
        *,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        max_catch_up_tokens: int = 2048,
    ) -> None:
        """``max_catch_up_tokens``: the most tokens one catch-up forward pass computes (a long
        history catches up over several, as a long prompt prefills in chunks)."""
        self.runner = runner
        self.device = torch.device(device)
        self.max_catch_up_tokens = max_catch_up_tokens
        # the draws of unseeded sampled requests
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed((seed ^ _DRAFT_SEED_SALT) & 0xFFFF_FFFF_FFFF_FFFF)
        self.drafted_tokens = 0  # totals, for tests and metrics
        self.accepted_tokens = 0

    @torch.inference_mode()
    def propose(self, slots: list[DraftSlot], grammars: GrammarMasks | None = None) -> None:
        """Fills each slot's ``drafts`` (and ``probs`` for sampled requests). A request with a
        grammar drafts only tokens its grammar allows after the drafts before them."""
        live = [s for s in slots if not s.state.finished]
        for slot in slots:
            if slot.state.finished:  # the scheduler ran ahead: its tokens are discarded
                slot.drafts = [0] * slot.k
                slot.probs = None
        if not live:
            return
        for slot in live:
            _check_history(slot)
        rows: list[list[torch.Tensor]] = [[] for _ in live]  # q rows of sampled requests
        walks = [_walk(s, grammars) for s in live]
        try:
            self._pick(live, self._catch_up(live), rows, walks)
            for step in range(1, max(s.k for s in live)):
                active = [i for i, s in enumerate(live) if s.k > step]
                batch = _next_token_batch([live[i] for i in active], step, self.device)
                logits = self.runner.forward(batch)
                picked = [live[i] for i in active]
                self._pick(picked, logits, [rows[i] for i in active], [walks[i] for i in active])
        finally:
            for walk in walks:  # verification walks the real matcher through the drafts again
                if walk is not None:
                    walk.rollback()
        for slot, q in zip(live, rows, strict=True):
            slot.probs = torch.stack(q) if q else None
            # the catch-up and the steps before the last wrote positions start .. start + k - 1
            slot.state.draft_computed = slot.start + slot.k
        self.drafted_tokens += sum(s.k for s in live)

    def _catch_up(self, slots: list[DraftSlot]) -> torch.Tensor:
        """The draft model's logits after each request's last sampled token, once its K/V hold
        every known position; forward passes of at most ``max_catch_up_tokens`` tokens."""
        begin = [min(s.state.draft_computed, s.start) for s in slots]
        end = [s.start + 1 for s in slots]
        rows: list[torch.Tensor] = [torch.empty(0)] * len(slots)
        while True:
            pieces: list[tuple[int, int, int]] = []  # (slot index, first position, end)
            budget = self.max_catch_up_tokens
            for i in range(len(slots)):
                if begin[i] < end[i] and budget > 0:
                    hi = min(end[i], begin[i] + budget)
                    pieces.append((i, begin[i], hi))
                    budget -= hi - begin[i]
            if not pieces:
                return torch.stack(rows)
            logits = self.runner.forward(_catch_up_batch(slots, pieces, self.device))
            for row, (i, _, hi) in enumerate(pieces):
                begin[i] = hi
                if hi == end[i]:
                    rows[i] = logits[row]

    def settle(self, slot: DraftSlot, accepted: int) -> None:
        """After verification: only the positions of emitted tokens hold valid draft K/V (the
        rejected drafts' are rewritten by a later catch-up before anything reads them)."""
        state = slot.state
        state.draft_computed = min(state.draft_computed, slot.start + accepted + 1)
        self.accepted_tokens += accepted

    def _pick(
        self,
        slots: list[DraftSlot],
        logits: torch.Tensor,
        rows: list[list[torch.Tensor]],
        walks: list[DraftWalk | None],
    ) -> None:
        """Each slot's next draft from its row of ``logits``."""
        for i, walk in enumerate(walks):
            if walk is not None:
                allowed = walk(len(slots[i].drafts)).to(logits.device)
                if bool(allowed.any()):
                    logits[i].masked_fill_(~allowed, float("-inf"))
        greedy = [is_greedy(s.state.params) for s in slots]
        argmax = logits.argmax(dim=-1).tolist() if any(greedy) else None
        for i, slot in enumerate(slots):
            if greedy[i]:
                assert argmax is not None
                slot.drafts.append(int(argmax[i]))
                continue
            q = torch.softmax(logits[i].float() / slot.state.params.temperature, dim=-1)
            token = torch.multinomial(q, 1, generator=self._generator(slot.state))
            slot.drafts.append(int(token))
            rows[i].append(q)

    def _generator(self, state: RequestState) -> torch.Generator:
        seed = state.params.seed
        if seed is None:
            return self.generator
        if state.draft_generator is None:
            state.draft_generator = torch.Generator(device=self.device)
            state.draft_generator.manual_seed((seed ^ _DRAFT_SEED_SALT) & 0xFFFF_FFFF_FFFF_FFFF)
        return state.draft_generator


def _walk(slot: DraftSlot, grammars: GrammarMasks | None) -> DraftWalk | None:
    """The request's grammar walking through its drafts as they are chosen (the walk reads
    ``slot.drafts``, which grows), or None."""
    if grammars is None or slot.state.grammar is None:
        return None
    return grammars.draft_walk(slot.state.grammar, slot.drafts)


def _check_history(slot: DraftSlot) -> None:
    known = len(slot.state.prompt_ids) + len(slot.state.output_ids)
    if known != slot.start + 1:
        raise ValueError(
            f"request {slot.state.rid}: a worker-drafted verify entry at position {slot.start}, "
            f"but the worker knows {known} of its tokens"
        )


def _known_tokens(state: RequestState, lo: int, hi: int) -> torch.Tensor:
    """int64 tokens ``lo .. hi - 1`` of the request's prompt followed by its output."""
    prompt = state.prompt_ids
    p = len(prompt)
    parts = []
    if lo < p:
        parts.append(prompt[lo : min(hi, p)])
    if hi > p:
        parts.append(torch.tensor(state.output_ids[max(lo - p, 0) : hi - p], dtype=torch.int64))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _catch_up_batch(
    slots: list[DraftSlot], pieces: list[tuple[int, int, int]], device: torch.device
) -> ForwardBatch:
    """Positions ``lo .. hi - 1`` of the known tokens of each piece's request, sampling after
    the last of each."""
    starts = [lo for _, lo, _ in pieces]
    counts = [hi - lo for _, lo, hi in pieces]
    tokens = [_known_tokens(slots[i].state, lo, hi) for i, lo, hi in pieces]
    positions = [torch.arange(lo, hi) for _, lo, hi in pieces]
    ends = torch.tensor(counts).cumsum(0)
    return ForwardBatch(
        input_ids=torch.cat(tokens).to(device),
        positions=torch.cat(positions).to(device),
        start_pos=starts,
        num_tokens=counts,
        block_tables=[slots[i].state.block_table for i, _, _ in pieces],
        sample_index=(ends - 1).to(device),
    )


def _next_token_batch(slots: list[DraftSlot], step: int, device: torch.device) -> ForwardBatch:
    """Draft ``step`` (d_step, already chosen) of each slot at position ``start + step``."""
    positions = [s.start + step for s in slots]
    ids = [s.drafts[step - 1] for s in slots]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        start_pos=positions,
        num_tokens=[1] * len(slots),
        block_tables=[s.state.block_table for s in slots],
        sample_index=torch.arange(len(slots), device=device),
    )
