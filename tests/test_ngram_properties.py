"""Property tests of the n-gram draft index (``pyserve._core.NgramIndex``, ``NgramCorpus``,
``ngram_draft``) against the scan in ``ngram_reference``.

A hypothesis state machine drives the core and the reference with the same calls (appends,
finished requests going into a small-budget corpus, drafts with random and invalid arguments)
over a vocabulary of a few tokens, so n-grams repeat, chains are long and eviction happens
often; every answer and every error must be identical. Nothing here measures speed.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable
from typing import Any

import ngram_reference as reference
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pyserve import _core as core

VOCAB = 4
TOKENS = st.lists(st.integers(0, VOCAB - 1), max_size=10)


def _same(core_call: Callable[[], Any], ref_call: Callable[[], Any]) -> Any:
    """Both calls return the same value, or both raise ValueError with the same message."""
    try:
        expected = ref_call()
    except ValueError as e:
        with pytest.raises(ValueError) as raised:
            core_call()
        assert str(raised.value) == str(e)
        return None
    got = core_call()
    assert got == expected
    return got


def _packed(tokens: list[int], as_bytes: bool) -> bytes | list[int]:
    return array("i", tokens).tobytes() if as_bytes else tokens


class NgramMachine(RuleBasedStateMachine):
    @initialize(max_ngram=st.integers(1, 5), budget=st.integers(0, 30))
    def setup(self, max_ngram: int, budget: int) -> None:
        self.max_ngram = max_ngram
        self.core_index = core.NgramIndex(max_ngram)
        self.ref_index = reference.NgramIndex(max_ngram)
        self.core_corpus = core.NgramCorpus(max_ngram, budget)
        self.ref_corpus = reference.NgramCorpus(max_ngram, budget)

    @rule(tokens=TOKENS, as_bytes=st.booleans())
    def append(self, tokens: list[int], as_bytes: bool) -> None:
        self.core_index.append(_packed(tokens, as_bytes))
        self.ref_index.append(tokens)

    @rule(tokens=TOKENS, as_bytes=st.booleans())
    def add_sequence(self, tokens: list[int], as_bytes: bool) -> None:
        self.core_corpus.add_sequence(_packed(tokens, as_bytes))
        self.ref_corpus.add_sequence(tokens)

    @rule()
    def finish_request(self) -> None:
        """The request's history goes into the corpus and a new request starts."""
        history = list(self.ref_index.tokens)
        self.core_corpus.add_sequence(history)
        self.ref_corpus.add_sequence(history)
        self.core_index = core.NgramIndex(self.max_ngram)
        self.ref_index = reference.NgramIndex(self.max_ngram)

    @rule()
    def clear_corpus(self) -> None:
        self.core_corpus.clear()
        self.ref_corpus.clear()

    @rule(
        max_tokens=st.integers(0, 6),
        min_match=st.integers(1, 5),
        span=st.integers(0, 4),
        use_corpus=st.booleans(),
    )
    def draft(self, max_tokens: int, min_match: int, span: int, use_corpus: bool) -> None:
        max_match = min_match + span
        if max_match > self.max_ngram:
            return  # the invalid cases are the next rule's
        _same(
            lambda: self.core_index.draft(max_tokens, min_match, max_match),
            lambda: self.ref_index.draft(max_tokens, min_match, max_match),
        )
        history = self.ref_index.tokens
        _same(
            lambda: self.core_corpus.draft(history, max_tokens, min_match, max_match),
            lambda: self.ref_corpus.draft(history, max_tokens, min_match, max_match),
        )
        core_corpus = self.core_corpus if use_corpus else None
        ref_corpus = self.ref_corpus if use_corpus else None
        _same(
            lambda: core.ngram_draft(
                self.core_index, core_corpus, max_tokens, min_match, max_match
            ),
            lambda: reference.ngram_draft(
                self.ref_index, ref_corpus, max_tokens, min_match, max_match
            ),
        )

    @rule(
        context=TOKENS,
        max_tokens=st.integers(-2, 6),
        min_match=st.integers(-1, 7),
        max_match=st.integers(-1, 7),
    )
    def draft_any_arguments(
        self, context: list[int], max_tokens: int, min_match: int, max_match: int
    ) -> None:
        _same(
            lambda: self.core_index.draft(max_tokens, min_match, max_match),
            lambda: self.ref_index.draft(max_tokens, min_match, max_match),
        )
        _same(
            lambda: self.core_corpus.draft(context, max_tokens, min_match, max_match),
            lambda: self.ref_corpus.draft(context, max_tokens, min_match, max_match),
        )
        _same(
            lambda: core.ngram_draft(
                self.core_index, self.core_corpus, max_tokens, min_match, max_match
            ),
            lambda: reference.ngram_draft(
                self.ref_index, self.ref_corpus, max_tokens, min_match, max_match
            ),
        )

    @invariant()
    def sizes_agree(self) -> None:
        assert len(self.core_index) == len(self.ref_index)
        assert self.core_corpus.num_tokens == self.ref_corpus.num_tokens
        assert self.core_corpus.num_sequences == self.ref_corpus.num_sequences
        assert self.core_corpus.num_tokens <= self.core_corpus.token_budget


TestNgramMachine = NgramMachine.TestCase
TestNgramMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(TOKENS, max_size=8),
    max_ngram=st.integers(1, 6),
    max_tokens=st.integers(0, 8),
    data=st.data(),
)
def test_incremental_appends_draft_like_a_scan(
    chunks: list[list[int]], max_ngram: int, max_tokens: int, data: st.DataObject
) -> None:
    """After every append, however the history was cut into appends, drafts equal the scan."""
    index = core.NgramIndex(max_ngram)
    history: list[int] = []
    for chunk in chunks:
        index.append(chunk)
        history += chunk
        max_match = data.draw(st.integers(1, max_ngram))
        min_match = data.draw(st.integers(1, max_match))
        _, expected = reference.scan([history], history, max_tokens, min_match, max_match)
        assert index.draft(max_tokens, min_match, max_match) == expected
    whole = core.NgramIndex(max_ngram)
    whole.append(history)
    for n in range(1, max_ngram + 1):
        assert whole.draft(max_tokens, 1, n) == index.draft(max_tokens, 1, n)


def test_edge_cases() -> None:
    empty = core.NgramIndex(4)
    assert len(empty) == 0
    assert empty.draft(4, 1, 4) == []
    assert core.ngram_draft(empty, core.NgramCorpus(4, 10), 4, 1, 4) == []
    index = core.NgramIndex(4)
    index.append([1, 2, 3])
    assert index.draft(4, 1, 4) == []  # the suffix occurs only at the end, nothing after it
    index.append([1, 2])
    assert index.draft(0, 1, 4) == []
    assert index.draft(1, 1, 4) == [3]
    assert index.draft(9, 1, 4) == [3, 1, 2]  # stops at the history's end
    corpus = core.NgramCorpus(4, 10)
    assert corpus.draft([], 4, 1, 4) == []
    corpus.add_sequence([5, 6])
    assert corpus.draft([6], 4, 1, 4) == []  # the match ends its sequence
    assert corpus.draft(array("i", [5]), 4, 1, 4) == [6]


def test_bad_arguments_raise_value_error() -> None:
    index = core.NgramIndex(4)
    with pytest.raises(ValueError, match=r"min_match \(3\) must not exceed max_match \(2\)"):
        index.draft(4, 3, 2)
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        index.draft(-1, 1, 2)
    with pytest.raises(ValueError, match="max_match"):
        index.draft(4, 1, 5)
    with pytest.raises(ValueError, match="max_ngram must be in"):
        core.NgramIndex(0)
    with pytest.raises(ValueError, match="token_budget"):
        core.NgramCorpus(4, -1)


def test_token_ids_out_of_range() -> None:
    index = core.NgramIndex(2, vocab_size=8)
    index.append([1, 2])
    with pytest.raises(ValueError, match=r"tokens\[1\] = 8 is out of range \[0, 8\)"):
        index.append([3, 8])
    assert len(index) == 2  # nothing of the bad call was appended
    with pytest.raises(ValueError, match="out of range"):
        index.append([-1])
    with pytest.raises(ValueError, match="does not fit in int32"):
        index.append([2**31])
    corpus = core.NgramCorpus(2, 10, vocab_size=8)
    with pytest.raises(ValueError, match="out of range"):
        corpus.add_sequence([1, 9])
    assert corpus.num_sequences == 0
    with pytest.raises(ValueError, match="out of range"):
        corpus.draft([1, 9], 2, 1, 2)


def test_corpus_eviction_under_a_small_budget() -> None:
    corpus = core.NgramCorpus(2, 5)
    corpus.add_sequence([1, 2, 3])
    corpus.add_sequence([1, 2, 4])  # 6 > 5: the first goes
    assert (corpus.num_sequences, corpus.num_tokens) == (1, 3)
    assert corpus.draft([1, 2], 3, 1, 2) == [4]
    corpus.add_sequence(list(range(7)))  # longer than the budget: its last 5 tokens stay
    assert (corpus.num_sequences, corpus.num_tokens) == (1, 5)
    assert corpus.draft([2], 3, 1, 2) == [3, 4, 5]
    assert corpus.draft([1], 3, 1, 2) == []


def test_threads_share_a_corpus() -> None:
    """Requests drafting on their own threads while another fills the corpus: no deadlock, and
    every draft is a run of tokens the corpus or the request holds."""
    corpus = core.NgramCorpus(4, 4096)
    pattern = [1, 2, 3, 4, 5, 6, 7] * 40
    errors: list[BaseException] = []

    def request() -> None:
        try:
            index = core.NgramIndex(4)
            for t in pattern:
                index.append([t])
                for token in core.ngram_draft(index, corpus, 4, 1, 4):
                    assert 1 <= token <= 7
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def producer() -> None:
        try:
            for _ in range(200):
                corpus.add_sequence(array("i", pattern * 4).tobytes())  # long: releases the GIL
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=request) for _ in range(3)]
    threads.append(threading.Thread(target=producer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    assert corpus.num_tokens <= corpus.token_budget
