"""Anthropic's Messages API dialect: the whole ``message`` body and the stream's events.

A stream is ``message_start``; then each content block as ``content_block_start``, its
``content_block_delta``s (``thinking_delta``, ``text_delta``, ``input_json_delta``) and
``content_block_stop``; then ``message_delta`` (stop reason, usage) and ``message_stop``.
``ping``s come while the prompt prefills; an error after the first byte is an ``error`` event.
Blocks open as the chat policy's deltas need them: a thought, the text, one block per tool call,
in the order the output writes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from pyserve.chat.output import OutputDelta, ParsedMessage
from pyserve.chat.tool_stream import ToolCall
from pyserve.http.anthropic_errors import error_body
from pyserve.http.errors import APIError
from pyserve.http.openai_format import TEXT_PLACEHOLDER, ContentTemplate
from pyserve.http.sse import event
from pyserve.outputs import GenerationChunk

if TYPE_CHECKING:
    from pyserve.http.pipeline import ChoiceResult

_encode = msgspec.json.encode
PING = event(b'{"type":"ping"}', b"ping")
MESSAGE_STOP = event(b'{"type":"message_stop"}', b"message_stop")


def tool_use_id(call_id: str) -> str:
    """Anthropic's id shape (``toolu_...``) for a call id the chat policy made."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object ``tool_use.input`` is (the parser reports JSON text of
    an object; anything else would not be a call)."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, matched_stop: str | int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a choice's finish as the chat policy reports it."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "timeout":  # pyserve's: the request's deadline passed (README, "Deadlines")
        return "timeout", None
    if finish == "stop" and isinstance(matched_stop, str):  # a stop string, not a stop token
        return "stop_sequence", matched_stop
    return "end_turn", None


def usage(result: ChoiceResult) -> dict:
    """Anthropic counts the cached part of the prompt apart from ``input_tokens``: their sum is
    the prompt."""
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "output_tokens": result.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": result.cached_tokens,
    }


def thinking_block(thinking: str) -> dict:
    # A signature proves a thought came from Anthropic's servers; ours have none to give.
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.name,
        "input": tool_input(call.arguments),
    }


def content_blocks(message: ParsedMessage) -> list[dict]:
    blocks = []
    if message.reasoning:
        blocks.append(thinking_block(message.reasoning))
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    blocks += [tool_use_block(call) for call in message.tool_calls]
    return blocks


# the text delta of the one block (index 0) of an unparsed output, cut around its text
_TEXT_DELTA = {
    "type": "content_block_delta",
    "index": 0,
    "delta": {"type": "text_delta", "text": TEXT_PLACEHOLDER},
}


class MessagesFormat:
    """One Messages response (Anthropic has one choice), whole or streamed. ``parsed``: the
    output is read by the chat policy; ``prompt_tokens``: the rendered prompt's length, which
    ``message_start`` reports before the prefix cache has been consulted."""

    token_text = None
    eager = True  # message_start at once, then pings while the prompt prefills

    def __init__(self, id: str, model: str, prompt_tokens: int, parsed: bool) -> None:
        self.id = id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.parsed = parsed
        self._text_delta = ContentTemplate(_encode(_TEXT_DELTA), b"content_block_delta")
        self._blocks = 0  # blocks opened so far
        self._open: str | None = None  # the type of the open block (the last one opened)
        self._call_blocks: dict[int, int] = {}  # tool call index → its block's index

    # ------------------------------------------------------------------ whole

    def response(self, results: list[ChoiceResult], messages: list[ParsedMessage] | None) -> bytes:
        (result,) = results
        if messages is not None:
            message = messages[0]
            finish = message.finish_reason
        else:
            message = ParsedMessage(result.text)
            finish = result.finish_reason
        reason, sequence = stop_reason(finish, result.matched_stop)
        return _encode(
            {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": content_blocks(message),
                "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": usage(result),
            }
        )

    # ------------------------------------------------------------------ stream

    def preamble(self) -> list[bytes]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return [event(_encode({"type": "message_start", "message": message}), b"message_start")]

    def ping(self) -> bytes | None:
        return PING

    @property
    def stateless(self) -> bool:
        """Unparsed, the output is one text block, opened with the first text: from then on
        each chunk's delta is a pure render (the pipeline's direct-write path)."""
        return not self.parsed and self._open == "text"

    def opening(self, index: int) -> list[bytes]:
        return []  # blocks open with the content that needs them

    def content(
        self, index: int, chunk: GenerationChunk, delta: OutputDelta | None
    ) -> bytes | None:
        if not self.parsed:
            if not chunk.text:
                return None
            if self._open != "text":
                start = b"".join(self._start({"type": "text", "text": ""}))
                return start + self._text_delta.render(chunk.text)
            return self._text_delta.render(chunk.text)
        if delta is None:
            return None
        frames = self._frames(delta)
        return b"".join(frames) if frames else None

    def closing(
        self, index: int, result: ChoiceResult, held: OutputDelta | None, finish: str | None
    ) -> list[bytes]:
        frames = self._frames(held) if held is not None else []
        frames += self._close()
        reason, sequence = stop_reason(finish, result.matched_stop)
        body = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(result),  # totals: they replace message_start's
        }
        frames.append(event(_encode(body), b"message_delta"))
        return frames

    def end(self, results: list[ChoiceResult]) -> list[bytes]:
        return [MESSAGE_STOP]

    def error(self, error: APIError) -> list[bytes]:
        return [event(error_body(error), b"error")]

    # ------------------------------------------------------------------ blocks

    def _frames(self, delta: OutputDelta) -> list[bytes]:
        frames: list[bytes] = []
        if delta.reasoning:
            if self._open != "thinking":
                frames += self._start(thinking_block(""))
            frames.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self._open != "text":
                frames += self._start({"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its own block, its input streamed as JSON
                block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name}
                frames += self._start({**block, "input": {}})
                self._call_blocks[call.index] = self._blocks - 1
            if call.arguments:
                fragment = {"type": "input_json_delta", "partial_json": call.arguments}
                frames.append(self._delta(fragment, self._call_blocks[call.index]))
        return frames

    def _start(self, block: dict) -> list[bytes]:
        frames = self._close()
        body = {"type": "content_block_start", "index": self._blocks, "content_block": block}
        frames.append(event(_encode(body), b"content_block_start"))
        self._open = block["type"]
        self._blocks += 1
        return frames

    def _delta(self, delta: dict, index: int | None = None) -> bytes:
        index = self._blocks - 1 if index is None else index
        body = {"type": "content_block_delta", "index": index, "delta": delta}
        return event(_encode(body), b"content_block_delta")

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        body = {"type": "content_block_stop", "index": self._blocks - 1}
        return [event(_encode(body), b"content_block_stop")]
