"""The Responses API's dialect without a server: its Format fed a parsed stream as the pipeline
feeds it (split at every possible place), its input items, and its store.

The event order checked here is OpenAI's, as its API reference and the openai SDK's stream
types define it: response.created, response.in_progress, then for each output item
output_item.added, its content part (content_part.added, the text's deltas, the text's .done,
content_part.done) or a call's arguments (function_call_arguments.delta ..., .done), and
output_item.done; last response.completed (.incomplete when cut off; error and .failed after
an error). Every event has the next sequence_number, from 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import stat

import msgspec
import pytest
from format_testlib import pipeline_frames
from hypothesis import given, settings
from hypothesis import strategies as st

from pyserve.chat.output import ChatOutput
from pyserve.chat.reasoning import ReasoningParser
from pyserve.chat.tool_calls import PARSERS
from pyserve.http.errors import APIError, bad_request
from pyserve.http.pipeline import ChoiceResult
from pyserve.http.responses_format import ResponseMeta, ResponsesFormat
from pyserve.http.responses_protocol import (
    function_tools,
    input_items,
    template_messages,
    tool_choice,
)
from pyserve.http.responses_store import Record, ResponseStore, owner_of
from pyserve.outputs import GenerationChunk

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'  # noqa: E501
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
TEXT = f"The user wants\nweather.</think>\n\nLet me look.{CALL}\n{CALL2}"
OUTPUT = ChatOutput(tools=PARSERS["hermes"](), reasoning=ReasoningParser(starts_inside=True))
META = ResponseMeta(id="resp_1", created_at=0, model="m", settings={"store": False})

ITEM = (
    r"(?:output_item\.added "
    r"(?:content_part\.added (?:output_text\.delta )*output_text\.done content_part\.done "
    r"|content_part\.added (?:reasoning_text\.delta )*reasoning_text\.done content_part\.done "
    r"|(?:function_call_arguments\.delta )*function_call_arguments\.done )"
    r"output_item\.done )"
)
ORDER = re.compile(rf"created in_progress {ITEM}*(?:completed|incomplete)")
FAILED = re.compile(rf"created in_progress {ITEM}*(?:output_item\.added .*)?error failed")


def chunk(text: str, finish: str | None = None) -> GenerationChunk:
    return GenerationChunk(
        rid="r",
        text=text,
        token_ids=[1],
        prompt_tokens=3,
        completion_tokens=1,
        cached_tokens=2,
        finish_reason=finish,
    )


def decode(frames: list[bytes]) -> list[dict]:
    events = []
    for frame in frames:
        for block in frame.split(b"\n\n"):
            if not block:
                continue
            name, data = block.split(b"\n")
            body = msgspec.json.decode(data.removeprefix(b"data: "))
            assert name == b"event: " + body["type"].encode()
            events.append(body)
    return events


def stream(output: ChatOutput | None, pieces: list[str], finish: str) -> list[dict]:
    """The events the pipeline writes for one response generated as ``pieces``."""
    stored: list[dict] = []
    fmt = ResponsesFormat(META, parsed=output is not None, on_done=stored.append)
    last = len(pieces) - 1
    chunks = [chunk(piece, finish if i == last else None) for i, piece in enumerate(pieces)]
    events = decode(pipeline_frames(fmt, output, pieces, chunks, finish))
    assert stored == [events[-1]["response"]]  # stored before the last event went out
    return events


def whole(output: ChatOutput | None, text: str, finish: str) -> dict:
    result = ChoiceResult()
    result.add(chunk(text, finish))
    messages = [output.message(text, finish)] if output is not None else None
    fmt = ResponsesFormat(META, parsed=output is not None)
    return msgspec.json.decode(fmt.response([result], messages))


def check_order(events: list[dict]) -> None:
    names = " ".join(e["type"].removeprefix("response.") for e in events)
    assert ORDER.fullmatch(names) or FAILED.fullmatch(names), names
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    items: dict[int, dict] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(items) and e["item"]["status"] == "in_progress"
            items[e["output_index"]] = e["item"]
        elif "item_id" in e:
            assert items[e["output_index"]]["id"] == e["item_id"]


def assembled(events: list[dict]) -> dict:
    """What the deltas add up to, per kind, checked against each .done event."""
    texts: dict[str, str] = {}
    out = {"reasoning": "", "content": "", "calls": []}
    for e in events:
        kind = e["type"]
        key = e.get("item_id", "")
        if kind.endswith(".delta"):
            texts[key] = texts.get(key, "") + e["delta"]
        elif kind == "response.output_text.done":
            assert e["text"] == texts.get(key, "")
            out["content"] += e["text"]
        elif kind == "response.reasoning_text.done":
            assert e["text"] == texts.get(key, "")
            out["reasoning"] += e["text"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == texts.get(key, "")
            out["calls"].append((e["name"], json.loads(e["arguments"])))
    return out


def cut(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=16))
def test_streamed_events_follow_openais_order_and_add_up_to_the_whole_response(cuts) -> None:
    events = stream(OUTPUT, cut(TEXT, cuts), "stop")
    check_order(events)
    got = assembled(events)
    body = whole(OUTPUT, TEXT, "stop")
    reasoning, message, *calls = body["output"]
    assert got["reasoning"] == reasoning["content"][0]["text"] == "The user wants\nweather."
    assert got["content"] == message["content"][0]["text"] == "Let me look."
    expected = [(c["name"], json.loads(c["arguments"])) for c in calls]
    assert (
        got["calls"]
        == expected
        == [
            ("get_weather", {"city": "Paris", "days": [1, 2]}),
            ("get_time", {"zone": "CET"}),
        ]
    )
    final = events[-1]
    assert final["type"] == "response.completed"
    response = final["response"]
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert [i["type"] for i in response["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert all(i["status"] == "completed" for i in response["output"])
    for item in response["output"][2:]:
        assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    assert response["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 4,
    }


THOUGHT_ONLY = "a long thought that the output limit cuts\nin the mid"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(THOUGHT_ONLY)), max_size=12))
def test_a_thought_cut_off_by_the_limit_is_an_incomplete_reasoning_item(cuts) -> None:
    events = stream(OUTPUT, cut(THOUGHT_ONLY, cuts), "length")
    check_order(events)
    assert assembled(events)["reasoning"] == THOUGHT_ONLY
    final = events[-1]
    assert final["type"] == "response.incomplete"
    response = final["response"]
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = response["output"]
    assert item["type"] == "reasoning" and item["status"] == "incomplete"
    body = whole(OUTPUT, THOUGHT_ONLY, "length")
    assert body["status"] == "incomplete" and body["output"][0]["status"] == "incomplete"
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": THOUGHT_ONLY}]


def test_a_response_cut_off_by_its_deadline_is_incomplete_for_that_reason() -> None:
    events = stream(OUTPUT, cut(THOUGHT_ONLY, []), "timeout")
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "timeout"}
    body = whole(OUTPUT, THOUGHT_ONLY, "timeout")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "timeout"}


def test_an_unparsed_stream_is_one_message_and_a_repeated_chunk_keeps_its_number() -> None:
    fmt = ResponsesFormat(META, parsed=False)
    assert fmt.stateless  # the direct sink may render its chunks
    frames = [*fmt.preamble(), *fmt.opening(0)]
    result = ChoiceResult()
    for piece in ["Hel", "", "lo \u00e9\n", '"x"']:
        c = chunk(piece)
        result.add(c)
        first = fmt.content(0, c, None)
        assert fmt.content(0, c, None) == first  # declined by the sink, sent by the handler
        if first is not None:
            frames.append(first)
    result.add(chunk("", "stop"))
    frames += fmt.closing(0, result, None, "stop") + fmt.end([result])
    events = decode(frames)
    check_order(events)
    assert assembled(events)["content"] == 'Hello \u00e9\n"x"'
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == 'Hello \u00e9\n"x"'


def test_an_error_mid_stream_ends_with_error_and_failed() -> None:
    fmt = ResponsesFormat(META, parsed=True)
    parser = OUTPUT.stream()
    frames = [*fmt.preamble(), fmt.content(0, chunk("thinking"), parser.feed("thinking"))]
    frames += fmt.error(APIError(500, "boom", type="server_error", code="engine_dead"))
    events = decode([f for f in frames if f])
    check_order(events)
    assert events[-2]["type"] == "error" and events[-2]["message"] == "boom"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "engine_dead", "message": "boom"}


def test_a_plain_answer_whole_is_one_message() -> None:
    body = whole(None, "Hi there", "stop")
    assert body["object"] == "response" and body["status"] == "completed"
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [
        {"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}
    ]
    assert list(body)[-1] == "usage"


# ----------------------------------------------------------------------------- input items


def test_input_items_become_the_template_messages() -> None:
    items = input_items(
        [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "not json"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ]
    )
    assert all(item["id"] for item in items)
    messages = template_messages("Instructions.", items)
    assert messages == [
        {"role": "system", "content": "Instructions."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "reasoning_content": "hm",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": "not json"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert template_messages(None, input_items("Hello")) == [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ([{"type": "nope"}], "input[0].type", None),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
         "input[0].content[0].type", "unsupported_parameter"),
        ([{"role": "user", "content": [{"type": "bogus", "text": "x"}]}],
         "input[0].content[0].type", None),
        ([{"type": "web_search_call", "id": "w"}], "input[0].type", "unsupported_parameter"),
        ([{"role": "robot", "content": "x"}], "input[0].role", "invalid_value"),
        ([{"type": "function_call", "call_id": "c", "name": "bad name!", "arguments": "{}"}],
         "input[0].name", "invalid_value"),
        ([{"type": "reasoning", "summary": [], "encrypted_content": "zz"}],
         "input[0].encrypted_content", "unsupported_parameter"),
        ([{"type": "function_call_output", "output": "x"}], "input[0]", "invalid_value"),
    ],
)  # fmt: skip
def test_bad_input_items_are_refused_by_name(body, param, code) -> None:
    with pytest.raises(APIError) as caught:
        input_items(body)
    assert caught.value.status == 400
    assert caught.value.info.param == param
    if code is not None:
        assert caught.value.info.code == code


def test_only_function_tools_and_known_tool_choices_pass() -> None:
    [tool] = function_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert tool.function.name == "f" and tool.function.parameters == {"type": "object"}
    for kind in ("web_search", "file_search", "code_interpreter", "mcp", "custom"):
        with pytest.raises(APIError) as caught:
            function_tools([{"type": kind}])
        assert kind in caught.value.message and caught.value.info.param == "tools[0].type"
    assert tool_choice("required") == "required"
    assert tool_choice({"type": "function", "name": "f"}).function.name == "f"
    for bad in ("sometimes", {"type": "web_search_preview"}, {"type": "function"}):
        with pytest.raises(APIError):
            tool_choice(bad)
    assert isinstance(bad_request("x"), APIError)


# ----------------------------------------------------------------------------- store


def record(i: int, size: int = 0) -> Record:
    return Record({"id": f"resp_{i}", "output": [], "pad": "x" * size}, [], [])


def test_the_store_is_private_persistent_bounded_and_per_key(tmp_path) -> None:
    directory = tmp_path / "state"

    async def first_life() -> None:
        store = ResponseStore(directory, max_bytes=10_000)
        store.put("resp_a", owner_of("k1"), record(0))
        # visible at once, before the write behind it
        assert (await store.get("resp_a", owner_of("k1"))).response["id"] == "resp_0"
        assert await store.get("resp_a", owner_of("k2")) is None
        assert await store.get("resp_a", "") is None
        await asyncio.gather(*(asyncio.sleep(0) for _ in range(3)))
        for i in range(1, 40):  # concurrent puts: ~1 KB each, so the oldest are evicted
            store.put(f"resp_{i}", "", record(i, 900))
        await store.close()

    asyncio.run(first_life())
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory / "responses.sqlite3").st_mode) == 0o600

    async def second_life() -> None:
        store = ResponseStore(directory, max_bytes=10_000)
        assert (await store.get("resp_39", "")).response["id"] == "resp_39"
        assert await store.get("resp_a", owner_of("k1")) is None  # the oldest went first
        assert await store.get("resp_1", "") is None
        kept = [i for i in range(1, 40) if await store.get(f"resp_{i}", "") is not None]
        assert kept == list(range(40 - len(kept), 40)) and 5 <= len(kept) <= 11
        assert await store.delete("resp_39", "")
        assert await store.get("resp_39", "") is None
        assert not await store.delete("resp_39", "")
        await store.close()

    asyncio.run(second_life())


def test_a_store_of_zero_bytes_keeps_nothing(tmp_path) -> None:
    async def run() -> None:
        store = ResponseStore(tmp_path / "none", max_bytes=0)
        store.put("resp_a", "", record(0))
        assert await store.get("resp_a", "") is None
        await store.close()

    asyncio.run(run())
    assert not (tmp_path / "none").exists()
