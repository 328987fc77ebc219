"""Anthropic's Messages dialect (pyserve.http.anthropic_format) fed parsed outputs as the
pipeline feeds it, without a server: the stream's events follow Anthropic's documented order
and assemble to the whole message, for any split of the output into generated pieces (tool
arguments as input_json_delta, thoughts as thinking_delta); stop reasons and error shapes."""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest
from format_testlib import pipeline_frames
from hypothesis import given
from hypothesis import strategies as st
from messages_testlib import assemble, check_order, parse_sse

from pyserve.chat.output import ChatOutput
from pyserve.chat.reasoning import ReasoningParser
from pyserve.chat.tool_calls import PARSERS
from pyserve.http.anthropic_errors import error_body, error_type
from pyserve.http.anthropic_format import MessagesFormat, stop_reason
from pyserve.http.errors import APIError
from pyserve.http.pipeline import ChoiceResult
from pyserve.outputs import GenerationChunk

PROMPT_TOKENS, CACHED = 40, 16

HERMES = ChatOutput(tools=PARSERS["hermes"](), reasoning=ReasoningParser(starts_inside=True))
HERMES_TEXT = (
    "The user wants the weather, 世界 and all.</think>\n\nLet me look."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5]}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "a \\"b\\" c"}}'
    "\n</tool_call>"
)
GENERIC = ChatOutput(tools=PARSERS["generic"]())
GENERIC_TEXT = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rio \\u00e9", "n": -1e3}}, '
    '{"name": "get_time", "arguments": {}}]}'
)
THOUGHT = ChatOutput(reasoning=ReasoningParser(starts_inside=True))
THOUGHT_TEXT = "Hmm. Let me think\nabout </thin this: <think> 😀 and more"


def chunk(text: str, tokens: int, finish: str | None = None, matched=None) -> GenerationChunk:
    return GenerationChunk(
        rid="r",
        text=text,
        token_ids=[1],
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=tokens,
        cached_tokens=CACHED,
        finish_reason=finish,
        matched_stop=matched,
    )


def stream_events(
    output: ChatOutput | None, pieces: list[str], finish: str, matched=None
) -> list[dict]:
    """The events the pipeline writes for one choice generated as ``pieces`` (a ping while
    the prompt prefills), as pyserve.http.pipeline.Pipeline._stream drives a format."""
    fmt = MessagesFormat("msg_1", "m", PROMPT_TOKENS, parsed=output is not None)
    last = len(pieces) - 1
    chunks = [
        chunk(piece, i + 1, finish if i == last else None, matched if i == last else None)
        for i, piece in enumerate(pieces)
    ]
    frames = pipeline_frames(fmt, output, pieces, chunks, finish, ping=True)
    return [data for _, data in parse_sse(b"".join(frames))]


def whole(output: ChatOutput | None, text: str, finish: str, matched=None) -> dict:
    result = ChoiceResult()
    result.add(chunk(text, 7, finish, matched))
    messages = None if output is None else [output.message(text, finish)]
    fmt = MessagesFormat("msg_1", "m", PROMPT_TOKENS, parsed=output is not None)
    return msgspec.json.decode(fmt.response([result], messages))


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def without_ids(blocks: list[dict]) -> list[dict]:
    for block in blocks:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_") and len(block["id"]) > 10
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def check_stream_equals_whole(output, text: str, cuts: list[int], finish: str = "stop") -> dict:
    events = stream_events(output, split(text, cuts), finish)
    check_order(events)
    streamed, body = assemble(events), whole(output, text, finish)
    assert without_ids(streamed["content"]) == without_ids(body["content"])
    assert streamed["stop_reason"] == body["stop_reason"]
    assert streamed["usage"] == body["usage"] | {
        "output_tokens": streamed["usage"]["output_tokens"]
    }
    return body


@given(st.lists(st.integers(0, len(HERMES_TEXT)), max_size=16))
def test_thought_text_and_hermes_calls_stream_as_their_blocks(cuts: list[int]) -> None:
    body = check_stream_equals_whole(HERMES, HERMES_TEXT, cuts)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, weather, time = body["content"]
    assert thinking == {
        "type": "thinking",
        "thinking": "The user wants the weather, 世界 and all.",
        "signature": "",
    }
    assert text == {"type": "text", "text": "Let me look."}
    assert (weather["name"], weather["input"]) == (
        "get_weather",
        {"city": "Paris", "days": [1, 2.5]},
    )
    assert (time["name"], time["input"]) == ("get_time", {"zone": 'a "b" c'})
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None


@given(st.lists(st.integers(0, len(GENERIC_TEXT)), max_size=16))
def test_generic_calls_stream_their_input_as_json_fragments(cuts: list[int]) -> None:
    body = check_stream_equals_whole(GENERIC, GENERIC_TEXT, cuts)
    assert [(b["type"], b["name"], b["input"]) for b in body["content"]] == [
        ("tool_use", "get_weather", {"city": "Rio é", "n": -1000.0}),
        ("tool_use", "get_time", {}),
    ]


@given(
    st.lists(st.integers(0, len(THOUGHT_TEXT)), max_size=16), st.sampled_from(["stop", "length"])
)
def test_a_thought_never_closed_is_one_thinking_block(cuts: list[int], finish: str) -> None:
    body = check_stream_equals_whole(THOUGHT, THOUGHT_TEXT, cuts, finish)
    assert body["content"] == [{"type": "thinking", "thinking": THOUGHT_TEXT, "signature": ""}]
    assert body["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[finish]


@given(st.lists(st.integers(0, 20), max_size=6))
def test_unparsed_text_is_one_text_block(cuts: list[int]) -> None:
    text = "Plain words, 世界, 😀!"
    body = check_stream_equals_whole(None, text, [c for c in cuts if c <= len(text)])
    assert body["content"] == [{"type": "text", "text": text}]


def test_the_whole_message_and_its_usage() -> None:
    body = whole(None, "Hi", "stop", matched="END")
    assert body == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "stop_sequence",
        "stop_sequence": "END",
        "usage": {
            "input_tokens": PROMPT_TOKENS - CACHED,  # Anthropic counts the cached part apart
            "output_tokens": 7,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": CACHED,
        },
    }
    events = stream_events(None, ["H", "i"], "stop", matched="END")
    check_order(events)
    assert events[0]["message"]["usage"]["input_tokens"] == PROMPT_TOKENS
    final = assemble(events)
    assert (final["stop_reason"], final["stop_sequence"]) == ("stop_sequence", "END")
    assert final["usage"] == body["usage"] | {"output_tokens": 2}


def test_an_empty_output_has_no_blocks() -> None:
    assert whole(None, "", "stop")["content"] == []
    events = stream_events(None, [""], "stop")
    check_order(events)
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]


@pytest.mark.parametrize(
    ("finish", "matched", "expected"),
    [
        ("tool_calls", None, ("tool_use", None)),
        ("length", None, ("max_tokens", None)),
        ("timeout", None, ("timeout", None)),  # the request's deadline passed
        ("stop", "###", ("stop_sequence", "###")),
        ("stop", 2, ("end_turn", None)),  # an EOS token is no stop sequence
        ("stop", None, ("end_turn", None)),
        (None, None, ("end_turn", None)),
    ],
)
def test_stop_reasons(finish, matched, expected) -> None:
    assert stop_reason(finish, matched) == expected


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_errors_take_anthropics_shape(status, kind) -> None:
    error = APIError(status, "what went wrong")
    assert error_type(status) == kind
    expected = {"type": "error", "error": {"type": kind, "message": "what went wrong"}}
    assert json.loads(error_body(error)) == expected
    fmt = MessagesFormat("msg_1", "m", 3, parsed=False)
    events = [fmt.preamble()[0], *fmt.error(error)]
    parsed = parse_sse(b"".join(events))
    assert parsed[-1] == ("error", expected)
    check_order([data for _, data in parsed])
