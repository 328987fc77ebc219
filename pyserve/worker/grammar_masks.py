"""Grammar-constrained sampling in the worker: one llguidance matcher per constrained request.

Each step, the token masks of the constrained rows are computed on a thread while the forward
pass runs (llguidance drops the GIL and spreads the batch over its own threads), and applied to
the logits before sampling; the sampled token then advances the request's matcher. A grammar
that is complete ends its request with "stop".

Matchers are built on a background thread when a request arrives, from a compiled grammar
kept per grammar text (a new request of a known grammar gets a copy, which costs microseconds);
the vocabulary's token trie (about a second for 50k tokens) is built once, on the first request
of any kind, by which time the main process has loaded the tokenizer (and, for a GGUF, cached its
conversion).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pyserve.grammars import llguidance_grammar
from pyserve.wire.main_to_worker import Grammar

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

log = logging.getLogger("pyserve.worker")

_COMPILED_CACHE = 256  # grammars whose pristine matcher is kept for copying


@dataclass(eq=False)
class GrammarState:
    """A request's matcher (being built, then built)."""

    matcher: Future[LLMatcher]
    done: bool = False  # the grammar is complete (or failed): the request ends
    failed: bool = False  # it ends in error: its matcher did not build, or rejected a token


_BIAS_OF_BIT = np.array([-np.inf, 0.0], dtype=np.float32)  # forbidden, allowed


@dataclass
class StepMasks:
    """The allowed tokens of some rows of one step's sampling batch, as what to add to their
    logits: 0 where allowed, -inf where forbidden (one vectorised add applies it; a boolean
    masked_fill of the same size is much slower on the CPU)."""

    rows: list[int]
    bias: torch.Tensor  # float32 [len(rows), vocab]

    @classmethod
    def from_allowed(cls, rows: list[int], allowed: torch.Tensor | np.ndarray) -> StepMasks:
        bits = np.asarray(allowed, dtype=np.uint8)
        return cls(rows, torch.from_numpy(_BIAS_OF_BIT[bits]))

    @property
    def allowed(self) -> torch.Tensor:
        return self.bias == 0


class GrammarMasks:
    def __init__(
        self,
        tokenizer_file: Callable[[], str] | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.tokenizer_file = tokenizer_file  # called once, on the first request
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        # compiling a new grammar must not hold up the masks of running requests
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="pyserve-grammar-compile")
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="pyserve-grammar-mask")
        self._tokenizer: Future[LLTokenizer] | None = None
        self._executor: LLExecutor | None = None
        self._compiled: OrderedDict[Grammar, LLMatcher] = OrderedDict()

    def warm_up(self) -> None:
        """Starts building the vocabulary's trie; call once requests arrive."""
        if self._tokenizer is None and self.tokenizer_file is not None:
            self._tokenizer = self._compiler.submit(self._build_tokenizer)

    def _build_tokenizer(self) -> LLTokenizer:
        from llguidance import LLExecutor, LLTokenizer

        assert self.tokenizer_file is not None
        with open(self.tokenizer_file(), encoding="utf-8") as f:
            text = f.read()
        tokenizer = LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        self._executor = LLExecutor()
        return tokenizer

    def start(self, grammar: Grammar) -> GrammarState:
        """A request's grammar state; its matcher is built on the compiling thread (a step that
        needs its first mask before then waits for it)."""
        if self.tokenizer_file is None:
            raise ValueError("this worker was started without a tokenizer: no grammars")
        self.warm_up()
        matcher = self._compiler.submit(self._new_matcher, grammar)
        return GrammarState(matcher=matcher)

    def _new_matcher(self, grammar: Grammar) -> LLMatcher:
        from llguidance import LLMatcher

        compiled = self._compiled.get(grammar)
        if compiled is None:
            assert self._tokenizer is not None
            tokenizer = self._tokenizer.result()
            compiled = LLMatcher(tokenizer, llguidance_grammar(grammar), log_level=0)
            if compiled.is_error():
                raise ValueError(f"the grammar does not compile: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            while len(self._compiled) > _COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def masks(self, states: Sequence[GrammarState | None]) -> Future[StepMasks] | None:
        """The masks of the active grammars among ``states`` (one per sampling row), computed
        on the masking thread; None when no row is constrained."""
        rows = [i for i, g in enumerate(states) if g is not None and not g.done]
        if not rows:
            return None
        return self._masker.submit(self._compute, rows, [states[i] for i in rows])

    def _compute(self, rows: list[int], states: list[GrammarState]) -> StepMasks:
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)  # failed rows: free
        matchers: list[tuple[LLMatcher, int]] = []
        for k, state in enumerate(states):
            try:
                matchers.append((state.matcher.result(), k))
            except Exception as exc:  # the main process checked it: not expected
                log.error("a grammar failed to compile in the worker: %s", exc)
                state.done = state.failed = True  # the request fails at this step's token
        if matchers:
            assert self._executor is not None  # made with the tokenizer the matchers needed
            # one call for the batch (llguidance's own helper module would import torch.compile)
            self._executor.unsafe_compute_mask_ptr(
                matchers, bitmask.data_ptr(), words * 4, len(rows)
            )
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return StepMasks.from_allowed(rows, bits[:, : self.vocab_size])

    def draft_walk(self, state: GrammarState, drafts: list[int]) -> DraftWalk | None:
        """The masks of a verify entry's positions (None when the grammar is done: the request
        ends at this step, unconstrained like a done row of ``masks``)."""
        if state.done:
            return None
        try:
            matcher = state.matcher.result()
        except Exception as exc:  # the main process checked it: not expected
            log.error("a grammar failed to compile in the worker: %s", exc)
            state.done = state.failed = True
            return None
        return DraftWalk(matcher, drafts, self.vocab_size)

    def advance(self, state: GrammarState, token: int) -> bool:
        """Feeds the sampled ``token``; True when the grammar is done (the request ends): it is
        complete, or it failed (``state.failed``)."""
        if state.done:
            return True
        matcher = state.matcher.result()
        if not matcher.consume_token(token) or matcher.is_error():
            # The token was sampled under this matcher's own mask: a rejection means the mask
            # and the matcher disagree, a bug to surface rather than an end of the answer.
            log.error(
                "a grammar rejected the token %d sampled under its mask: %s",
                token,
                matcher.get_error(),
            )
            state.done = state.failed = True
        elif matcher.is_stopped():
            state.done = True
        return state.done

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._masker.shutdown(wait=False, cancel_futures=True)


class DraftWalk:
    """``allowed(i)`` for speculative verification: the tokens the grammar allows after the
    request's output and drafts ``0 .. i-1``. The request's own matcher walks through the drafts
    (asked in order, each draft allowed by the previous mask) and ``rollback`` takes it back, so
    that only emitted tokens advance it for good."""

    def __init__(self, matcher: LLMatcher, drafts: list[int], vocab_size: int) -> None:
        self.matcher = matcher
        self.drafts = drafts
        self.vocab_size = vocab_size
        self.consumed = 0  # drafts the matcher has taken
        self.stuck = False  # it refused a draft: later positions are unconstrained

    def __call__(self, i: int) -> torch.Tensor:
        while self.consumed < i and not self.stuck:
            # a draft the grammar stops at (an EOS after a complete answer) may be refused:
            # tokens after it are never emitted, whatever their masks; so is one beyond the
            # vocabulary (an n-gram copied from an image's ids), which no sample can equal
            draft = self.drafts[self.consumed]
            if draft < self.vocab_size and self.matcher.try_consume_tokens([draft]) == 1:
                self.consumed += 1
            else:
                self.stuck = True
        if self.stuck:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.zeros(self.vocab_size, dtype=bool)
        unpacked = np.unpackbits(bits, bitorder="little").astype(bool)[: self.vocab_size]
        allowed[: len(unpacked)] = unpacked  # logits may be wider than the tokenizer
        return torch.from_numpy(allowed)

    def rollback(self) -> None:
        if self.consumed:
            self.matcher.rollback(self.consumed)
            self.consumed = 0


def apply_masks(logits: torch.Tensor, masks: StepMasks) -> None:
    """Sets the logits of forbidden tokens to -inf, in place. A row whose other constraints
    (``min_tokens``, ``logit_bias``) forbid everything the grammar allows falls back to the
    grammar's choice alone, rather than to an arbitrary token."""
    bias = masks.bias.to(logits.device, non_blocking=True)
    if masks.rows == list(range(logits.shape[0])):  # every row constrained: in place
        logits.add_(bias)
        index = None
        empty = torch.isneginf(logits.amax(dim=1))
    else:
        index = torch.tensor(masks.rows, device=logits.device)
        logits.index_add_(0, index, bias)
        empty = torch.isneginf(logits.index_select(0, index).amax(dim=1))
    if bool(empty.any()):
        targets = empty.nonzero().flatten() if index is None else index[empty]
        logits[targets] = bias[empty]  # 0 where the grammar allows: its choice, uniformly
