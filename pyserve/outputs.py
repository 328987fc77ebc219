"""What ``Engine.generate`` / ``Engine.chat`` yield: the contract between the engine and HTTP."""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # (token id, logprob), best first


class GenerationChunk(msgspec.Struct, omit_defaults=True):
    """One increment of one request's output.

    ``text`` is the new text since the previous chunk; ``token_ids`` the tokens sampled since the
    previous chunk (text may lag a little behind tokens: a half UTF-8 character or a possible
    stop string is held back). The last chunk has ``finish_reason`` set.
    """

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int  # total so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with speculative decoding: drafted tokens the request accepted (set on the last chunk)
    spec_accepted_tokens: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for


class Embedding(msgspec.Struct):
    """What ``Engine.embed`` returns."""

    embedding: list[float]
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (last-token pooling)


class RerankResult(msgspec.Struct):
    """What ``Engine.rerank`` returns: a relevance score per document, in their order."""

    scores: list[float]
    prompt_tokens: int
