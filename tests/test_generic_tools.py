"""The generic tool-call format (pyserve.chat.generic_tools) without a model: the reply object
read and streamed, the grammars that force the object, the prompt that describes the tools, and
the assistant message built from it. Calls and text that is not the object are covered with the
other formats in test_tool_call_parsers."""

from __future__ import annotations

import json

import pytest
from chat_testlib import openai_message, openai_stream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer
from test_tool_call_parsers import CUTS, split, stream_pieces

from pyserve import model_files
from pyserve.chat.generic_tools import REPLY_SCHEMA, GenericPrompt, instructions
from pyserve.chat.output import ChatOutput
from pyserve.chat.tool_calls import PARSERS, GenericToolParser
from pyserve.chat.tool_grammar import tool_calls_lark, tool_calls_or_json_lark
from pyserve.grammars import llguidance_grammar
from pyserve.wire.main_to_worker import Grammar

GENERIC = GenericToolParser()

# Replies, and the content each one is: its string decoded; text that is not JSON as written.
REPLIES = [
    (
        '{"response": "Hello, \\"you\\".\\n\\u00e9 \\ud83d\\ude00 \\/ tab\\t"}',
        'Hello, "you".\né 😀 / tab\t',
    ),
    ('  {"response" : "raw\nnewline"}  ', "raw\nnewline"),
    ('{"response": ""}', None),
    ('{"response": "lone \\ud83d then text"}', "lone \ufffd then text"),
    ('{"response": "lone \\udc00 low, \\ud800\\u0041"}', "lone \ufffd low, \ufffdA"),
    ('{"response": "cut off', "cut off"),
    ('{"response": "cut in an escape \\u00', "cut in an escape \\u00"),
    ('{"response": "cut after a high half \\ud83d', "cut after a high half \ufffd"),
    ('{"response": "a bad \\x escape"} kept', 'a bad \\x escape"} kept'),
    ('{"response": "more keys", "x": 1}', 'more keys, "x": 1}'),
    ('{"response": "text after"} {"tool_calls": []}', 'text after {"tool_calls": []}'),
    ('{"response": "closed"}\n', "closed"),
]


@pytest.mark.parametrize(("text", "content"), REPLIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=CUTS)
def test_a_reply_is_its_string_streamed_or_whole(text, content, cuts) -> None:
    parsed = GENERIC.parse(text)
    assert parsed.content == content and parsed.tool_calls == []
    assert stream_pieces(GENERIC, split(text, cuts)) == (content or "", [])
    assert stream_pieces(GENERIC, list(text)) == (content or "", [])


def test_a_reply_streams_as_it_is_generated() -> None:
    stream = GENERIC.stream()
    assert stream.feed('{"resp') == ("", [])
    assert stream.feed('onse": "Hel') == ("Hel", [])
    assert stream.feed("lo \\") == ("lo ", [])  # the escape waits for its letter
    assert stream.feed('n"') == ("\n", [])
    assert stream.feed("}") == ("", [])
    assert stream.finish() == ("", [])


def test_text_that_is_not_the_object_streams_as_soon_as_that_is_clear() -> None:
    stream = GENERIC.stream()
    assert stream.feed(" {") == ("", [])
    assert stream.feed('"answer') == (' {"answer', [])
    assert stream.feed('": 1}') == ('": 1}', [])


@settings(max_examples=80, deadline=None)
@given(
    reply=st.text(),
    ensure_ascii=st.booleans(),
    cuts=CUTS,
)
def test_any_reply_string_comes_back_exactly(reply, ensure_ascii, cuts) -> None:
    text = json.dumps({"response": reply}, ensure_ascii=ensure_ascii)
    # A lone surrogate cannot be sent as UTF-8: it becomes the replacement character.
    expected = reply.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert GENERIC.parse(text).content == (expected or None)
    assert stream_pieces(GENERIC, split(text, cuts)) == (expected, [])


@settings(max_examples=80, deadline=None)
@given(text=st.text(), cuts=CUTS)
def test_free_text_that_is_not_the_object_is_kept_whole(text, cuts) -> None:
    if text.lstrip(" \t\n\r").startswith("{"):
        text = "x" + text
    assert GENERIC.parse(text).content == (text or None)
    assert stream_pieces(GENERIC, split(text, cuts)) == (text, [])


@settings(max_examples=30, deadline=None)
@given(cuts=CUTS)
def test_under_a_response_format_the_reply_object_is_plain_json(cuts) -> None:
    parser = GenericToolParser(replies=False)
    answer = '{"response": "mine"}'
    assert parser.parse(answer).content == answer
    assert stream_pieces(parser, split(answer, cuts)) == (answer, [])
    calls = '{"tool_calls": [{"name": "f", "arguments": {}}]}'
    assert parser.parse(calls).tool_calls[0].name == "f"
    assert stream_pieces(parser, split(calls, cuts)) == ("", [("f", "{}")])


def test_the_format_renders_one_object_of_calls() -> None:
    calls = [("f", {"a": 1}), ("g", {})]
    assert GENERIC.call_format.render(calls) == (
        '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}'
    )
    assert PARSERS["generic"] is GenericToolParser


# ---------------------------------------------------------------------------------------------
# Grammars

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", WEATHER), ("now", None)]


@pytest.fixture(scope="module")
def tokenizer() -> LLTokenizer:
    source = model_files.resolve_model(None)
    path = model_files.tokenizer_dir(source) / "tokenizer.json"
    return LLTokenizer(path.read_text(encoding="utf-8"), eos_token=2)


def accepts(tokenizer: LLTokenizer, lark: str, text: str) -> bool:
    matcher = LLMatcher(tokenizer, llguidance_grammar(Grammar("lark", lark)), log_level=0)
    return all(matcher.consume_token(t) for t in tokenizer.tokenize_str(text)) and (
        matcher.is_accepting()
    )


def test_required_is_the_object_of_calls_and_nothing_else(tokenizer) -> None:
    fmt = GENERIC.call_format
    lark = tool_calls_lark(fmt, TOOLS, parallel=True)
    two = fmt.render([("get_weather", {"city": "Oslo"}), ("now", {})])
    assert accepts(tokenizer, lark, two)
    assert not accepts(tokenizer, lark, '{"response": "no"}')
    assert not accepts(tokenizer, lark, '{"tool_calls": []}')
    assert not accepts(tokenizer, lark, fmt.render([("get_weather", {"town": "Oslo"})]))
    single = tool_calls_lark(fmt, TOOLS, parallel=False)
    assert accepts(tokenizer, single, fmt.render([("now", {})]))
    assert not accepts(tokenizer, single, two)


def test_auto_is_calls_or_a_reply_object(tokenizer) -> None:
    fmt = GENERIC.call_format
    lark = tool_calls_or_json_lark(tool_calls_lark(fmt, TOOLS, parallel=True), REPLY_SCHEMA)
    assert accepts(tokenizer, lark, fmt.render([("now", {})]))
    assert accepts(tokenizer, lark, '{"response": "It is \\"sunny\\"."}')
    assert not accepts(tokenizer, lark, "It is sunny.")
    assert not accepts(tokenizer, lark, '{"response": 3}')


def test_auto_with_a_response_format_is_calls_or_that_json(tokenizer) -> None:
    fmt = GENERIC.call_format
    calls = tool_calls_lark(fmt, TOOLS, parallel=True)
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    lark = tool_calls_or_json_lark(calls, answer)
    assert accepts(tokenizer, lark, fmt.render([("now", {})]))
    assert accepts(tokenizer, lark, '{"ok": true}')
    assert not accepts(tokenizer, lark, '{"response": "no"}')
    any_object = tool_calls_or_json_lark(calls, None)
    assert accepts(tokenizer, any_object, fmt.render([("now", {})]))
    assert accepts(tokenizer, any_object, '{"tool": 1}')


# ---------------------------------------------------------------------------------------------
# The prompt

TOOL_DEFS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now"}},
]


def test_the_instructions_describe_the_tools_and_the_object_asked_for() -> None:
    auto = instructions(TOOL_DEFS)
    assert '{"name": "get_weather", "description": "Weather", "parameters": {' in auto
    assert '{"name": "now", "parameters": {"type": "object"}}' in auto
    assert '{"tool_calls": [' in auto and '{"response": "<your reply>"}' in auto
    required = instructions(TOOL_DEFS, required=True, parallel=False)
    assert "exactly one tool" in required and '"response"' not in required
    named = instructions(TOOL_DEFS, named="now")
    assert '{"tool_calls": [{"name": "now", "arguments": {...}}]}' in named
    assert '"response"' not in named
    assert '"response"' not in instructions(TOOL_DEFS, json_answer=True)


def test_the_instructions_go_before_the_system_message_or_make_one() -> None:
    prompt = GenericPrompt("TOOLS")
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompt.messages(own)[0] == {"role": "system", "content": "TOOLS\n\nBe brief."}
    assert prompt.messages(own[1:]) == [{"role": "system", "content": "TOOLS"}, own[1]]
    assert GenericPrompt(None).messages(own) == own


def test_calls_and_results_in_the_history_become_text_the_template_renders() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "21 degrees at noon."},
    ]
    out = GenericPrompt(None).messages(history)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    assert json.loads(out[1]["content"]) == {
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "now", "arguments": {}},
        ]
    }
    assert "tool_calls" not in out[1]
    results = [json.loads(line) for line in out[2]["content"].splitlines()]
    assert results == [
        {"tool_response": {"name": "get_weather", "id": "call_1", "content": "21 degrees"}},
        {"tool_response": {"name": "now", "id": "call_2", "content": "noon"}},
    ]
    assert out[3] == history[4]


# ---------------------------------------------------------------------------------------------
# The assistant message

OUTPUT = ChatOutput(tools=GENERIC)


def test_a_reply_is_the_content_and_calls_are_tool_calls() -> None:
    message, finish = openai_message(OUTPUT, '{"response": "Hi there"}', "stop")
    assert message == {"role": "assistant", "content": "Hi there"} and finish == "stop"
    message, finish = openai_message(OUTPUT, '{"response": ""}', "stop")
    assert message["content"] == ""
    calls = '{"tool_calls": [{"name": "now", "arguments": {}}]}'
    message, finish = openai_message(OUTPUT, calls, "stop")
    assert message["content"] is None and finish == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


CALLS_TEXT = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "now", "arguments": {}}]}'
)


@pytest.mark.parametrize("text", [CALLS_TEXT, '{"response": "A reply \\u00e9."}'])
@settings(max_examples=40, deadline=None)
@given(cuts=CUTS)
def test_streamed_chunks_assemble_to_the_whole_message(text, cuts) -> None:
    choices = openai_stream(OUTPUT, split(text, cuts), "stop")
    content, calls = "", {}
    for choice in choices:
        delta = choice["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    message, finish = openai_message(OUTPUT, text, "stop")
    assert content == (message["content"] or "")
    whole = [
        [c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])
    ]
    assert list(calls.values()) == whole
    assert choices[-1]["finish_reason"] == finish
