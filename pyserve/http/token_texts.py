"""The text of single tokens, for the ``token`` and ``bytes`` fields of logprobs.

Decoding one token is microseconds, but a response with top-20 logprobs names thousands of
tokens; a per-app cache makes the common tokens free after their first use. A token that is
only part of a UTF-8 character decodes to U+FFFD, as in other OpenAI-compatible servers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pyserve.outputs import TokenLogprob


class TokenTexts:
    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            self.resolve([token_id])
            text = self._cache[token_id]
        return text

    def resolve(self, token_ids: Iterable[int]) -> None:
        """Decodes, in one batch, the tokens not in the cache yet."""
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._cache]
        if not missing:
            return
        texts = self._engine.tokenizer.backend_tokenizer.decode_batch(
            [[t] for t in missing], skip_special_tokens=False
        )
        self._cache.update(zip(missing, texts, strict=True))

    def resolve_logprobs(self, entries: Iterable[TokenLogprob]) -> None:
        self.resolve(t for lp in entries for t in (lp.token_id, *(top[0] for top in lp.top)))
