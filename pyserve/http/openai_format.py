"""OpenAI response bodies and stream chunks, built from the engine's GenerationChunks.

Pure functions over plain data: everything the engine would be asked (token texts) is resolved
by the caller first and passed in as ``token_text``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from pyserve.chat.output import OutputDelta, ParsedMessage
from pyserve.chat.tool_stream import ToolCallDelta
from pyserve.http.errors import APIError
from pyserve.http.sse import DONE, event
from pyserve.outputs import GenerationChunk, TokenLogprob

if TYPE_CHECKING:
    from pyserve.http.pipeline import ChoiceResult

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats: one id and one ``created`` for all of them."""

    id: str
    created: int
    model: str
    include_usage: bool = False  # streams only: every chunk then carries "usage": null


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


def chat_message(message: ParsedMessage) -> dict:
    """OpenAI's assistant message of a parsed output."""
    body: dict = {"role": "assistant", "content": message.content}
    if message.reasoning is not None:
        body["reasoning_content"] = message.reasoning
    if message.tool_calls:
        body["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    return body


def chat_delta(delta: OutputDelta) -> dict:
    """OpenAI's streamed delta of what a piece of output advanced."""
    body: dict = {}
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.content:
        body["content"] = delta.content
    if delta.tool_calls:
        body["tool_calls"] = [_call_delta(call) for call in delta.tool_calls]
    return body


def _call_delta(call: ToolCallDelta) -> dict:
    """OpenAI's streamed tool call: index, id, type and name first, then argument fragments."""
    if call.id is not None:
        return {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    return {"index": call.index, "function": {"arguments": call.arguments}}


def chat_response(
    meta: ResponseMeta,
    choices: list[ChoiceResult],
    n: int,
    token_text: TokenText | None,
    messages: list[ParsedMessage] | None = None,
) -> bytes:
    bodies = []
    for i, c in enumerate(choices):
        message: dict = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if messages is not None:
            message, finish_reason = chat_message(messages[i]), messages[i].finish_reason
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

TEXT_PLACEHOLDER = "\x00"
_ENCODEDTEXT_PLACEHOLDER = msgspec.json.encode(TEXT_PLACEHOLDER)
_encode_text = msgspec.json.encode


class ContentTemplate:
    """The SSE frame of one choice's content chunk cut around its text: every token of a stream
    repeats the same id, model and choice, so only the text is encoded per chunk."""

    __slots__ = ("prefix", "suffix")

    def __init__(self, sample: bytes, name: bytes | None = None) -> None:
        # ``sample``: the chunk encoded with TEXT_PLACEHOLDER as its text; ``name``: the event's
        frame = event(sample, name)
        self.prefix, self.suffix = frame.rsplit(_ENCODEDTEXT_PLACEHOLDER, 1)  # text comes last

    def render(self, text: str) -> bytes:
        return self.prefix + _encode_text(text) + self.suffix


class _OpenAIStream:
    """What chat and completion streams share: no preamble, no pings, usage and [DONE] at the
    end, an error as an error event and [DONE]."""

    eager = False
    object_name = ""

    def __init__(self, meta: ResponseMeta, n: int, token_text: TokenText | None) -> None:
        self.meta = meta
        self.id = meta.id
        self.n = n
        self.token_text = token_text  # None: no logprobs asked for
        self._templates: dict[int, ContentTemplate] = {}

    def preamble(self) -> list[bytes]:
        return []

    def ping(self) -> bytes | None:
        return None

    def end(self, results: list[ChoiceResult]) -> list[bytes]:
        if not self.meta.include_usage:
            return [DONE]
        return [event(usage_chunk(self.meta, self.object_name, usage_of(results, self.n))), DONE]

    def error(self, error: APIError) -> list[bytes]:
        return [event(error.body()), DONE]


class ChatFormat(_OpenAIStream):
    """Chat completion bodies; for streams, the chunks of each choice in order. ``parsed``:
    the output is read by the chat policy (each chunk comes with its OutputDelta)."""

    object_name = "chat.completion.chunk"

    def __init__(
        self, meta: ResponseMeta, n: int, token_text: TokenText | None, parsed: bool = False
    ) -> None:
        super().__init__(meta, n, token_text)
        self.parsed = parsed
        self.stateless = not parsed  # content() is then a pure render

    def opening(self, index: int) -> list[bytes]:
        return [event(chat_chunk(self.meta, index, {"role": "assistant", "content": ""}))]

    def content(
        self, index: int, chunk: GenerationChunk, delta: OutputDelta | None
    ) -> bytes | None:
        logprobs = None
        if self.token_text is not None and chunk.logprobs:
            logprobs = chat_logprobs(chunk.logprobs, self.token_text)
        if self.parsed:
            if delta is None and logprobs is None:
                return None
            body = chat_delta(delta) if delta is not None else {}
            return event(chat_chunk(self.meta, index, body, logprobs=logprobs))
        if logprobs is not None:
            return event(chat_chunk(self.meta, index, {"content": chunk.text}, logprobs=logprobs))
        if not chunk.text:
            return None
        template = self._templates.get(index)
        if template is None:
            sample = chat_chunk(self.meta, index, {"content": TEXT_PLACEHOLDER})
            template = self._templates[index] = ContentTemplate(sample)
        return template.render(chunk.text)

    def closing(
        self, index: int, result: ChoiceResult, held: OutputDelta | None, finish: str | None
    ) -> list[bytes]:
        frames = []
        if held is not None:
            frames.append(event(chat_chunk(self.meta, index, chat_delta(held))))
        frames.append(event(chat_chunk(self.meta, index, {}, finish_reason=finish)))
        return frames

    def response(self, results: list[ChoiceResult], messages: list[ParsedMessage] | None) -> bytes:
        return chat_response(self.meta, results, self.n, self.token_text, messages)


class CompletionFormat(_OpenAIStream):
    """Legacy completion bodies; ``echoes[i]`` is the prompt text echoed before choice i."""

    object_name = "text_completion"
    stateless = True

    def __init__(
        self, meta: ResponseMeta, n: int, echoes: list[str], token_text: TokenText | None
    ) -> None:
        super().__init__(meta, n, token_text)
        self.echoes = echoes
        self._offsets = [len(e) for e in echoes]  # text_offset of each choice's next token

    def opening(self, index: int) -> list[bytes]:
        echo = self.echoes[index]
        return [event(completion_chunk(self.meta, index, echo))] if echo else []

    def content(
        self, index: int, chunk: GenerationChunk, delta: OutputDelta | None
    ) -> bytes | None:
        if self.token_text is not None and chunk.logprobs:
            logprobs, self._offsets[index] = completion_logprobs(
                chunk.logprobs, self.token_text, self._offsets[index]
            )
            return event(completion_chunk(self.meta, index, chunk.text, logprobs=logprobs))
        if not chunk.text:
            return None
        template = self._templates.get(index)
        if template is None:
            sample = completion_chunk(self.meta, index, TEXT_PLACEHOLDER)
            template = self._templates[index] = ContentTemplate(sample)
        return template.render(chunk.text)

    def closing(
        self, index: int, result: ChoiceResult, held: OutputDelta | None, finish: str | None
    ) -> list[bytes]:
        return [event(completion_chunk(self.meta, index, "", finish_reason=finish))]

    def response(self, results: list[ChoiceResult], messages: list[ParsedMessage] | None) -> bytes:
        return completion_response(self.meta, results, self.n, self.echoes, self.token_text)
