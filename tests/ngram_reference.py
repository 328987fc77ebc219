"""A pure-Python model of the core's n-gram draft index (``pyserve._core.NgramIndex``,
``NgramCorpus`` and ``ngram_draft``), for the property tests.

Same class names, call signatures, results and errors as the core, computed the obvious way: a
draft scans the whole history, latest position first, for n from max_match down to min_match.
Plain and slow on purpose: the core's hashed chains must agree with it exactly.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Sequence

MAX_NGRAM = 64
INT32_MAX = 2**31 - 1


def _ints(values: bytes | bytearray | memoryview | Iterable[int]) -> list[int]:
    """Packed little-endian int32 bytes (like the core accepts) or a sequence of ints."""
    if isinstance(values, bytes | bytearray | memoryview):
        return array("i", bytes(values)).tolist()
    return list(values)


def _check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what}[{i}] = {t} is out of range [0, {vocab_size})")


def check_draft_args(max_tokens: int, min_match: int, max_match: int, max_ngram: int) -> None:
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if min_match < 1:
        raise ValueError(f"min_match must be >= 1, got {min_match}")
    if min_match > max_match:
        raise ValueError(f"min_match ({min_match}) must not exceed max_match ({max_match})")
    if max_match > max_ngram:
        raise ValueError(f"max_match ({max_match}) exceeds the index's max_ngram ({max_ngram})")


def _check_construction(max_ngram: int, vocab_size: int) -> None:
    if not 1 <= max_ngram <= MAX_NGRAM:
        raise ValueError(f"max_ngram must be in [1, {MAX_NGRAM}], got {max_ngram}")
    if not 1 <= vocab_size <= INT32_MAX:
        raise ValueError(f"vocab_size must be in [1, 2**31-1], got {vocab_size}")


def scan(
    sequences: Sequence[Sequence[int]],
    context: Sequence[int],
    max_tokens: int,
    min_match: int,
    max_match: int,
) -> tuple[int, list[int]]:
    """(match length, continuation): for n from max_match down to min_match, the latest
    occurrence (last sequence first, then latest start) of context's last n tokens that some
    token follows in its own sequence; the up to max_tokens tokens after it. (0, []) if none."""
    if max_tokens == 0:
        return 0, []
    for n in range(min(max_match, len(context)), min_match - 1, -1):
        key = list(context[len(context) - n :])
        for seq in reversed(sequences):
            for start in range(len(seq) - n - 1, -1, -1):
                if list(seq[start : start + n]) == key:
                    return n, list(seq[start + n : start + n + max_tokens])
    return 0, []


class NgramIndex:
    """One request's history; a draft looks for an earlier occurrence of its suffix."""

    def __init__(self, max_ngram: int, vocab_size: int = INT32_MAX) -> None:
        _check_construction(max_ngram, vocab_size)
        self.max_ngram = max_ngram
        self.vocab_size = vocab_size
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: bytes | Iterable[int]) -> None:
        values = _ints(tokens)
        _check_tokens(values, self.vocab_size, "tokens")
        self.tokens.extend(values)

    def lookup(self, max_tokens: int, min_match: int, max_match: int) -> tuple[int, list[int]]:
        check_draft_args(max_tokens, min_match, max_match, self.max_ngram)
        # scan only takes occurrences that a token follows, so the history's own suffix (with
        # nothing after it) never matches itself.
        return scan([self.tokens], self.tokens, max_tokens, min_match, max_match)

    def draft(self, max_tokens: int, min_match: int, max_match: int) -> list[int]:
        return self.lookup(max_tokens, min_match, max_match)[1]


class NgramCorpus:
    """Completed sequences under a token budget, oldest evicted first."""

    def __init__(self, max_ngram: int, token_budget: int, vocab_size: int = INT32_MAX) -> None:
        _check_construction(max_ngram, vocab_size)
        if not 0 <= token_budget <= INT32_MAX:
            raise ValueError(f"token_budget must be in [0, 2**31-1], got {token_budget}")
        self.max_ngram = max_ngram
        self.token_budget = token_budget
        self.vocab_size = vocab_size
        self.sequences: deque[list[int]] = deque()

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    def add_sequence(self, tokens: bytes | Iterable[int]) -> None:
        values = _ints(tokens)
        _check_tokens(values, self.vocab_size, "tokens")
        values = values[max(0, len(values) - self.token_budget) :]  # the last token_budget
        if not values:
            return
        self.sequences.append(values)
        while self.num_tokens > self.token_budget:
            self.sequences.popleft()

    def lookup(
        self, context: bytes | Iterable[int], max_tokens: int, min_match: int, max_match: int
    ) -> tuple[int, list[int]]:
        check_draft_args(max_tokens, min_match, max_match, self.max_ngram)
        values = _ints(context)
        # Only the tokens a lookup can read are checked (a whole history would cost O(history)).
        tail = values[len(values) - min(max_match, len(values)) :]
        _check_tokens(tail, self.vocab_size, "context tail")
        return scan(self.sequences, values, max_tokens, min_match, max_match)

    def draft(
        self, context: bytes | Iterable[int], max_tokens: int, min_match: int, max_match: int
    ) -> list[int]:
        return self.lookup(context, max_tokens, min_match, max_match)[1]

    def clear(self) -> None:
        self.sequences.clear()


def ngram_draft(
    request: NgramIndex,
    corpus: NgramCorpus | None,
    max_tokens: int,
    min_match: int,
    max_match: int,
) -> list[int]:
    """The longer match wins; the request's own on a tie (as the core)."""
    if corpus is not None:
        check_draft_args(max_tokens, min_match, max_match, corpus.max_ngram)
    own = request.lookup(max_tokens, min_match, max_match)
    if corpus is None or own[0] == max_match:
        return own[1]
    shared = corpus.lookup(request.tokens, max_tokens, min_match, max_match)
    return shared[1] if shared[0] > own[0] else own[1]
