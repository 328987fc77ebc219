"""A chat choice's text as OpenAI's assistant message (thought, content, tool calls), whole and
as SSE chunks, for any split of the text into generated pieces. No model or server."""

from __future__ import annotations

import itertools
import json

from chat_testlib import openai_message, openai_response, openai_stream
from hypothesis import given
from hypothesis import strategies as st

from pyserve.chat.output import ChatOutput
from pyserve.chat.reasoning import ReasoningParser
from pyserve.chat.tool_calls import PARSERS

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = f"The user wants weather.</think>\n\nLet me look.{CALL}"
OUTPUT = ChatOutput(tools=PARSERS["hermes"](), reasoning=ReasoningParser(starts_inside=True))


def test_the_whole_message_separates_thought_content_and_calls() -> None:
    message, finish = openai_message(OUTPUT, TEXT, "stop")
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert finish == "tool_calls"


def test_a_cut_off_output_keeps_length_and_plain_text_stays_content() -> None:
    assert openai_message(OUTPUT, TEXT, "length")[1] == "length"
    message, finish = openai_message(ChatOutput(tools=PARSERS["hermes"]()), "Just text.", "stop")
    assert message == {"role": "assistant", "content": "Just text."} and finish == "stop"


@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_streamed_deltas_assemble_to_the_whole_message(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(TEXT)]
    pieces = [TEXT[a:b] for a, b in itertools.pairwise(bounds)]
    choices = openai_stream(OUTPUT, pieces, "stop")
    thought = content = ""
    calls: dict[int, dict] = {}
    for choice in choices:
        delta = choice["delta"]
        thought += delta.get("reasoning_content", "")
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["function"]["name"]
                calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    message, _ = openai_message(OUTPUT, TEXT, "stop")
    assert thought == message["reasoning_content"] and content == message["content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_a_collected_response_has_the_parsed_message() -> None:
    body = openai_response(OUTPUT, TEXT, "stop")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user wants weather."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
