"""OpenAI response bodies and stream chunks, built from the engine's GenerationChunks.

Pure functions over plain data: everything the engine would be asked (token texts) is resolved
by the caller first and passed in as ``token_text``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from pyserve.http.chat_output import ChatOutput, ChatOutputStream
from pyserve.outputs import GenerationChunk, TokenLogprob

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats: one id and one ``created`` for all of them."""

    id: str
    created: int
    model: str
    include_usage: bool = False  # streams only: every chunk then carries "usage": null


@dataclass
class ChoiceResult:
    """One choice, accumulated from its chunks."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: str | int | None = None

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.text:
            self.text_parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(choices: list[ChoiceResult], n: int) -> dict:
    """Choices come in groups of ``n`` per prompt; a prompt's tokens are counted once."""
    prompts = choices[::n]
    return usage(
        sum(c.prompt_tokens for c in prompts),
        sum(c.completion_tokens for c in choices),
        sum(c.cached_tokens for c in prompts),
    )


# ----------------------------------------------------------------------------- logprobs


def _token_entry(token_id: int, logprob: float, token_text: TokenText) -> dict:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> dict:
    """``choice.logprobs`` of a chat completion: ``{"content": [...]}``."""
    content = []
    for lp in entries:
        item = _token_entry(lp.token_id, lp.logprob, token_text)
        item["top_logprobs"] = [_token_entry(t, v, token_text) for t, v in lp.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    entries: list[TokenLogprob], token_text: TokenText, text_offset: int
) -> tuple[dict, int]:
    """Legacy ``choice.logprobs`` and the text offset after these tokens.

    ``top_logprobs`` holds the requested alternatives plus the sampled token, as OpenAI does.
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in entries:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top = {token_text(t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, text_offset


# ----------------------------------------------------------------------------- chat


def chat_chunk(
    meta: ResponseMeta,
    index: int,
    delta: dict,
    *,
    logprobs: dict | None = None,
    finish_reason: str | None = None,
) -> bytes:
    body: dict = {
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if meta.include_usage:
        body["usage"] = None
    return msgspec.json.encode(body)


def usage_chunk(meta: ResponseMeta, obj: str, usage_body: dict) -> bytes:
    """The last event of a stream that asked for usage: no choices, only usage."""
    return msgspec.json.encode(
        {
            "id": meta.id,
            "object": obj,
            "created": meta.created,
            "model": meta.model,
            "choices": [],
            "usage": usage_body,
        }
    )


def chat_response(
    meta: ResponseMeta,
    choices: list[ChoiceResult],
    n: int,
    token_text: TokenText | None,
    output: ChatOutput | None = None,
) -> bytes:
    bodies = []
    for i, c in enumerate(choices):
        message: dict = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if output is not None:
            message, finish_reason = output.message(c.text, finish_reason)
        bodies.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs, token_text) if token_text else None,
                "finish_reason": finish_reason,
            }
        )
    return msgspec.json.encode(
        {
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": bodies,
            "usage": usage_of(choices, n),
        }
    )


# ----------------------------------------------------------------------------- completions


def completion_chunk(
    meta: ResponseMeta,
    index: int,
    text: str,
    *,
    logprobs: dict | None = None,
    finish_reason: str | None = None,
) -> bytes:
    body: dict = {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if meta.include_usage:
        body["usage"] = None
    return msgspec.json.encode(body)


def completion_response(
    meta: ResponseMeta,
    choices: list[ChoiceResult],
    n: int,
    echoes: list[str],
    token_text: TokenText | None,
) -> bytes:
    """``echoes[i]`` is the prompt text to put before choice i ('' without echo)."""
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if token_text is not None:
            logprobs, _ = completion_logprobs(c.logprobs, token_text, len(echoes[i]))
        out.append(
            {
                "index": i,
                "text": echoes[i] + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        )
    return msgspec.json.encode(
        {
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": out,
            "usage": usage_of(choices, n),
        }
    )


# ----------------------------------------------------------------------------- formats

_PLACEHOLDER = "\x00"
_ENCODED_PLACEHOLDER = msgspec.json.encode(_PLACEHOLDER)
_encode_text = msgspec.json.encode


class ContentTemplate:
    """A content chunk of one choice cut around its text: every token of a stream repeats the
    same id, model and choice, so only the text is encoded per chunk."""

    __slots__ = ("prefix", "suffix")

    def __init__(self, sample: bytes) -> None:
        # ``sample``: the chunk encoded with _PLACEHOLDER as its text
        self.prefix, self.suffix = sample.rsplit(_ENCODED_PLACEHOLDER, 1)  # text comes last

    def render(self, text: str) -> bytes:
        return self.prefix + _encode_text(text) + self.suffix


class ChatFormat:
    """Chat completion bodies; for streams, the chunks of each choice in order."""

    object_name = "chat.completion.chunk"

    def __init__(
        self,
        meta: ResponseMeta,
        n: int,
        token_text: TokenText | None,
        output: ChatOutput | None = None,
    ) -> None:
        self.meta = meta
        self.n = n
        self.token_text = token_text  # None: no logprobs asked for
        self.output = output  # reasoning and tool-call parsing; None: the text is the content
        self._templates: dict[int, ContentTemplate] = {}
        self._streams: dict[int, ChatOutputStream] = {}

    @property
    def stateless(self) -> bool:
        """Whether ``content`` is a pure render (it may be called twice for one chunk)."""
        return self.output is None

    def opening(self, index: int) -> list[bytes]:
        return [chat_chunk(self.meta, index, {"role": "assistant", "content": ""})]

    def content(self, index: int, chunk: GenerationChunk) -> bytes | None:
        if self.output is not None:
            return self._parsed_content(index, chunk)
        if self.token_text is not None and chunk.logprobs:
            logprobs = chat_logprobs(chunk.logprobs, self.token_text)
            return chat_chunk(self.meta, index, {"content": chunk.text}, logprobs=logprobs)
        if not chunk.text:
            return None
        template = self._templates.get(index)
        if template is None:
            sample = chat_chunk(self.meta, index, {"content": _PLACEHOLDER})
            template = self._templates[index] = ContentTemplate(sample)
        return template.render(chunk.text)

    def _parsed_content(self, index: int, chunk: GenerationChunk) -> bytes | None:
        stream = self._streams.get(index)
        if stream is None:
            assert self.output is not None
            stream = self._streams[index] = self.output.stream()
        delta = stream.feed(chunk.text) if chunk.text else None
        logprobs = None
        if self.token_text is not None and chunk.logprobs:
            logprobs = chat_logprobs(chunk.logprobs, self.token_text)
        if delta is None and logprobs is None:
            return None
        return chat_chunk(self.meta, index, delta or {}, logprobs=logprobs)

    def closing(self, index: int, finish_reason: str | None) -> list[bytes]:
        events = []
        stream = self._streams.get(index)
        if stream is not None:
            held = stream.finish()
            if held is not None:
                events.append(chat_chunk(self.meta, index, held))
            finish_reason = stream.finish_reason(finish_reason)
        events.append(chat_chunk(self.meta, index, {}, finish_reason=finish_reason))
        return events

    def usage(self, choices: list[ChoiceResult]) -> bytes:
        return usage_chunk(self.meta, self.object_name, usage_of(choices, self.n))

    def response(self, choices: list[ChoiceResult]) -> bytes:
        return chat_response(self.meta, choices, self.n, self.token_text, self.output)


class CompletionFormat:
    """Legacy completion bodies; ``echoes[i]`` is the prompt text echoed before choice i."""

    object_name = "text_completion"

    def __init__(
        self, meta: ResponseMeta, n: int, echoes: list[str], token_text: TokenText | None
    ) -> None:
        self.meta = meta
        self.n = n
        self.echoes = echoes
        self.token_text = token_text
        self._offsets = [len(e) for e in echoes]  # text_offset of each choice's next token
        self._templates: dict[int, ContentTemplate] = {}

    def opening(self, index: int) -> list[bytes]:
        echo = self.echoes[index]
        return [completion_chunk(self.meta, index, echo)] if echo else []

    def content(self, index: int, chunk: GenerationChunk) -> bytes | None:
        if self.token_text is not None and chunk.logprobs:
            logprobs, self._offsets[index] = completion_logprobs(
                chunk.logprobs, self.token_text, self._offsets[index]
            )
            return completion_chunk(self.meta, index, chunk.text, logprobs=logprobs)
        if not chunk.text:
            return None
        template = self._templates.get(index)
        if template is None:
            sample = completion_chunk(self.meta, index, _PLACEHOLDER)
            template = self._templates[index] = ContentTemplate(sample)
        return template.render(chunk.text)

    stateless = True

    def closing(self, index: int, finish_reason: str | None) -> list[bytes]:
        return [completion_chunk(self.meta, index, "", finish_reason=finish_reason)]

    def usage(self, choices: list[ChoiceResult]) -> bytes:
        return usage_chunk(self.meta, self.object_name, usage_of(choices, self.n))

    def response(self, choices: list[ChoiceResult]) -> bytes:
        return completion_response(self.meta, choices, self.n, self.echoes, self.token_text)
