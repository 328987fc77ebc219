"""The Responses API's dialect of the pipeline's output: response objects and their events.

Output items, in the order the model wrote them: a ``reasoning`` item (the reasoning parser's
thought, as ``reasoning_text`` content), a ``message`` with one ``output_text`` part, and a
``function_call`` item a call. Streamed, every event carries a ``sequence_number``, in OpenAI's
order::

    response.created, response.in_progress
    per item: response.output_item.added
        message:   response.content_part.added, response.output_text.delta ...,
                   response.output_text.done, response.content_part.done
        reasoning: response.content_part.added, response.reasoning_text.delta ...,
                   response.reasoning_text.done, response.content_part.done
        call:      response.function_call_arguments.delta ...,
                   response.function_call_arguments.done
    then response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it; after an error:
    error, response.failed)

A stream whose output is not parsed (no tools, no reasoning parser) is one message opened
before its first token; its deltas are then rendered from a template cut around the text and
the sequence number, and ``content`` may be asked twice for the same chunk (the direct sink
declines a write, the handler then sends it: ``direct_events``), so it remembers its last frame.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from pyserve.chat.output import OutputDelta, ParsedMessage
from pyserve.http.errors import APIError
from pyserve.http.responses_protocol import new_id
from pyserve.http.sse import event
from pyserve.outputs import GenerationChunk

if TYPE_CHECKING:
    from pyserve.http.pipeline import ChoiceResult

_encode = msgspec.json.encode


@dataclass
class ResponseMeta:
    """What every response object of one request repeats: its id, creation time, model and the
    request's settings as OpenAI echoes them (instructions, tools, text, reasoning, ...)."""

    id: str
    created_at: int
    model: str
    settings: dict = field(default_factory=dict)

    def response(
        self,
        status: str,
        output: list[dict],
        usage: dict | None = None,
        error: dict | None = None,
        finish: str | None = None,
    ) -> dict:
        incomplete_reason = "timeout" if finish == "timeout" else "max_output_tokens"
        body: dict = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": (
                {"reason": incomplete_reason} if status == "incomplete" else None
            ),
            "model": self.model,
            "output": output,
            **self.settings,
        }
        if status in ("completed", "incomplete"):
            body["completed_at"] = int(time.time())
        body["usage"] = usage  # last: the overhead benchmark finds it at the stream's end
        return body


def usage(result: ChoiceResult) -> dict:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def status_of(finish: str | None) -> str:
    """A response cut off by max_output_tokens (or the context), or by its deadline, is
    incomplete."""
    return "incomplete" if finish in ("length", "timeout") else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id: str, text: str, status: str) -> dict:
    return {
        "id": id,
        "type": "message",
        "status": status,
        "content": [_text_part(text)] if status != "in_progress" else [],
        "role": "assistant",
    }


def reasoning_item(id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {
        "id": id,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def call_item(id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": id,
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def output_items(message: ParsedMessage, finish: str | None) -> list[dict]:
    """The output items of a whole answer: its thought, its text, its calls."""
    status = status_of(finish)
    items = []
    if message.reasoning is not None:
        cut = message.content is None and not message.tool_calls
        items.append(
            reasoning_item(new_id("rs"), message.reasoning, status if cut else "completed")
        )
    if message.content or not (message.tool_calls or message.reasoning is not None):
        items.append(message_item(new_id("msg"), message.content or "", status))
    for call in message.tool_calls:
        items.append(call_item(new_id("fc"), call.id, call.name, call.arguments, "completed"))
    return items


class ResponsesFormat:
    """One response (the Responses API has no ``n``), whole or as its stream of events.
    ``parsed``: the output is read by the chat policy (each chunk comes with its delta).
    ``on_done`` is given the final response object (to store it) before its last event."""

    eager = False
    token_text = None

    def __init__(
        self, meta: ResponseMeta, parsed: bool, on_done: Callable[[dict], None] | None = None
    ) -> None:
        self.meta = meta
        self.id = meta.id
        self.parsed = parsed
        self.stateless = not parsed  # content() of an unparsed stream: see the module's doc
        self.on_done = on_done
        self._seq = 0
        self._items: list[dict] = []  # every output item so far, in order
        self._open: dict | None = None  # the item being written
        self._texts: list[str] = []  # the open message's or thought's text so far
        self._calls: dict[int, int] = {}  # a streamed call's index -> its output index
        self._finish: str | None = None
        self._delta_head = b""  # the open message's output_text.delta frame before its number
        self._last: tuple[GenerationChunk | None, bytes | None] = (None, None)

    # ------------------------------------------------------------------ events

    def _event(self, name: str, body: dict) -> bytes:
        body["sequence_number"] = self._seq
        self._seq += 1
        return event(_encode({"type": name, **body}), name.encode())

    def preamble(self) -> list[bytes]:
        response = self.meta.response("in_progress", [])
        return [
            self._event("response.created", {"response": response}),
            self._event("response.in_progress", {"response": response}),
        ]

    def ping(self) -> bytes | None:
        return None

    def opening(self, index: int) -> list[bytes]:
        return [] if self.parsed else self._start("message")

    def content(
        self, index: int, chunk: GenerationChunk, delta: OutputDelta | None
    ) -> bytes | None:
        if not self.parsed:
            last_chunk, last_frame = self._last
            if chunk is last_chunk:
                return last_frame
            frame = self._text_delta(chunk.text) if chunk.text else None
            self._last = (chunk, frame)
            return frame
        if delta is None:
            return None
        return b"".join(self._delta_frames(delta)) or None

    def closing(
        self, index: int, result: ChoiceResult, held: OutputDelta | None, finish: str | None
    ) -> list[bytes]:
        self._finish = finish
        frames = self._delta_frames(held) if held is not None else []
        if not self.parsed and self._open is not None:
            self._texts = [result.text]
        return frames + self._close(status_of(finish))

    def end(self, results: list[ChoiceResult]) -> list[bytes]:
        status = status_of(self._finish)
        response = self.meta.response(status, self._items, usage(results[0]), finish=self._finish)
        if self.on_done is not None:
            self.on_done(response)
        return [self._event(f"response.{status}", {"response": response})]

    def error(self, error: APIError) -> list[bytes]:
        info = error.info
        details = {"code": info.code or info.type, "message": info.message}
        response = self.meta.response("failed", self._items, error=details)
        return [
            self._event("error", {"code": info.code, "message": info.message, "param": info.param}),
            self._event("response.failed", {"response": response}),
        ]

    def response(self, results: list[ChoiceResult], messages: list[ParsedMessage] | None) -> bytes:
        result = results[0]
        message = messages[0] if messages is not None else ParsedMessage(result.text)
        finish = message.finish_reason if messages is not None else result.finish_reason
        output = output_items(message, finish)
        response = self.meta.response(status_of(finish), output, usage(result), finish=finish)
        if self.on_done is not None:
            self.on_done(response)
        return _encode(response)

    # ------------------------------------------------------------------ items

    def _delta_frames(self, delta: OutputDelta) -> list[bytes]:
        frames = []
        if delta.reasoning:
            if self._kind() != "reasoning":
                frames += self._close("completed") + self._start("reasoning")
            self._texts.append(delta.reasoning)
            frames.append(self._part_delta("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            if self._kind() != "message":
                frames += self._close("completed") + self._start("message")
            frames.append(self._text_delta(delta.content))
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its id and name come first
                frames += self._close("completed")
                item = call_item(new_id("fc"), call.id, call.name or "", "", "in_progress")
                self._calls[call.index] = len(self._items)
                frames += self._add(item)
            if call.arguments:
                output_index = self._calls[call.index]
                item = self._items[output_index]
                item["arguments"] += call.arguments
                body = {"item_id": item["id"], "output_index": output_index}
                body["delta"] = call.arguments
                frames.append(self._event("response.function_call_arguments.delta", body))
        return frames

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _add(self, item: dict) -> list[bytes]:
        output_index = len(self._items)
        self._items.append(item)
        self._open = item
        body = {"output_index": output_index, "item": item}
        return [self._event("response.output_item.added", body)]

    def _start(self, kind: str) -> list[bytes]:
        self._texts = []
        if kind == "message":
            item = message_item(new_id("msg"), "", "in_progress")
            part = _text_part("")
        else:
            item = reasoning_item(new_id("rs"), None, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        frames = self._add(item)
        body = {"item_id": item["id"], "output_index": len(self._items) - 1, "content_index": 0}
        frames.append(self._event("response.content_part.added", {**body, "part": part}))
        if kind == "message":  # the fixed head of this message's deltas, encoded once
            head = {"type": "response.output_text.delta", **body, "logprobs": []}
            self._delta_head = (
                b"event: response.output_text.delta\ndata: "
                + _encode(head)[:-1]
                + b',"sequence_number":'
            )
        return frames

    def _text_delta(self, text: str) -> bytes:
        """An output_text.delta of the open message: its head, number and text."""
        if self.parsed:  # an unparsed message's text is the choice's: see closing()
            self._texts.append(text)
        seq = self._seq
        self._seq += 1
        return self._delta_head + b"%d" % seq + b',"delta":' + _encode(text) + b"}\n\n"

    def _part_delta(self, name: str, text: str) -> bytes:
        item = self._open
        assert item is not None
        body = {"item_id": item["id"], "output_index": len(self._items) - 1, "content_index": 0}
        return self._event(name, {**body, "delta": text})

    def _close(self, status: str) -> list[bytes]:
        """The events that end the open item (none when none is open)."""
        item = self._open
        if item is None:
            return []
        self._open = None
        output_index = self._items.index(item)
        body = {"item_id": item["id"], "output_index": output_index}
        frames = []
        if item["type"] == "function_call":
            done = {**body, "arguments": item["arguments"], "name": item["name"]}
            frames.append(self._event("response.function_call_arguments.done", done))
        else:
            text = "".join(self._texts)
            body["content_index"] = 0
            if item["type"] == "message":
                part = _text_part(text)
                done = {**body, "text": text, "logprobs": []}
                frames.append(self._event("response.output_text.done", done))
            else:
                part = {"type": "reasoning_text", "text": text}
                frames.append(self._event("response.reasoning_text.done", {**body, "text": text}))
            frames.append(self._event("response.content_part.done", {**body, "part": part}))
            item["content"] = [part]
        item["status"] = status
        body = {"output_index": output_index, "item": item}
        frames.append(self._event("response.output_item.done", body))
        return frames
