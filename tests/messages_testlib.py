"""Anthropic Messages streams for the tests: SSE parsing, the event order Anthropic documents
(docs.anthropic.com, "Streaming Messages"), and the message a stream assembles to.

The documented order: ``message_start``; then content blocks, each a ``content_block_start``,
any number of ``content_block_delta``s and a ``content_block_stop``, indices counting from 0;
then ``message_delta`` (one or more) and ``message_stop``, the last event. ``ping`` events may
come anywhere after ``message_start``; an ``error`` event ends the stream wherever it comes.
"""

from __future__ import annotations

import json

# The delta types each block type takes
DELTAS = {
    "text": {"text_delta"},
    "tool_use": {"input_json_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
}


def parse_sse(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of every frame; each frame names its event, as the data's type."""
    events = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        assert len(lines) == 2, frame
        name, data = lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == name, frame
        events.append((name, data))
    return events


def check_order(events: list[dict]) -> None:
    """Asserts that ``events`` (the data of each) follow Anthropic's documented order."""
    assert events and events[0]["type"] == "message_start", events[:1]
    message = events[0]["message"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [] and message["stop_reason"] is None
    state, open_block, blocks = "blocks", None, 0
    for i, event in enumerate(events[1:], 1):
        kind = event["type"]
        if kind == "ping":
            assert event == {"type": "ping"}
            continue
        if kind == "error":
            assert i == len(events) - 1, "an error event ends the stream"
            assert event["error"]["type"] and isinstance(event["error"]["message"], str)
            return
        if state == "blocks" and kind == "content_block_start":
            assert open_block is None and event["index"] == blocks, event
            open_block = event["content_block"]["type"]
            assert open_block in DELTAS, event
            blocks += 1
        elif state == "blocks" and kind == "content_block_delta":
            assert open_block is not None and event["index"] == blocks - 1, event
            assert event["delta"]["type"] in DELTAS[open_block], event
        elif state == "blocks" and kind == "content_block_stop":
            assert open_block is not None and event["index"] == blocks - 1, event
            open_block = None
        elif kind == "message_delta" and open_block is None and state in ("blocks", "delta"):
            assert event["delta"]["stop_reason"] in (
                "end_turn", "max_tokens", "stop_sequence", "tool_use"
            )  # fmt: skip
            assert isinstance(event["usage"]["output_tokens"], int)
            state = "delta"
        elif kind == "message_stop" and state == "delta":
            assert i == len(events) - 1, "message_stop is the last event"
            return
        else:
            raise AssertionError(f"{kind} out of order at event {i}: {events}")
    raise AssertionError(f"the stream ended without message_stop: {events}")


def assemble(events: list[dict]) -> dict:
    """The message a (well-ordered) stream builds: message_start's, its blocks filled in by
    their deltas (tool inputs parsed from the joined JSON), the last message_delta applied."""
    message = json.loads(json.dumps(events[0]["message"]))
    inputs: dict[int, str] = {}
    for event in events[1:]:
        if event["type"] == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                inputs[event["index"]] = inputs.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "message_delta":
            message.update(event["delta"])
            message["usage"].update(event["usage"])
    for index, text in inputs.items():
        message["content"][index]["input"] = json.loads(text)
    return message
