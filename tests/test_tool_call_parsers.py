"""Tool-call parsing (pyserve.chat.tool_calls): whole outputs, and streams split anywhere."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pyserve.chat.tool_calls import (
    PARSERS,
    CallFormat,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCallParser,
    parser_for_template,
)
from pyserve.chat.tool_stream import ParsedOutput, new_call_id

HERMES = HermesToolParser()
LLAMA = Llama3JsonToolParser()
MISTRAL = MistralToolParser()


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def stream_pieces(parser: ToolCallParser, pieces: list[str]):
    """Feed the pieces; check the delta protocol; return (content, [(name, arguments)])."""
    stream = parser.stream()
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for result in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
        text, deltas = result
        content.append(text)
        for delta in deltas:
            if delta.index not in calls:
                # The first delta of a call names it, and calls are numbered in order.
                assert delta.index == len(calls)
                assert delta.id is not None and re.fullmatch(r"call_[A-Za-z0-9]{24}", delta.id)
                assert delta.name and delta.arguments == ""
                calls[delta.index] = [delta.name, ""]
            else:
                assert delta.id is None and delta.name is None and delta.arguments
                calls[delta.index][1] += delta.arguments
    assembled = [(name, arguments) for name, arguments in calls.values()]
    # What the stream says it sent is what it sent.
    assert [(c.name, c.arguments) for c in stream.tool_calls] == assembled
    return "".join(content), assembled


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


# Outputs whose streams must match parse() exactly, split anywhere.
EXACT = {
    "hermes": [
        "",
        "  \n",
        "Plain answer, no tools.",
        "An almost-marker <tool and <tool_call without the bracket, and < signs.",
        'a </tool_call> that closes nothing and a stray "<tool_call" prefix',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        '<tool_call>\n{"name": "write", "arguments": {"code": "def f():\\n\\treturn \\"\\u00e9\\"'
        ' \\ud83d\\ude00 \\/", "n": -1.50e3, "big": 12345678901234567890, "ok": true,'
        ' "none": null, "nested": [1, [2, {}], [], {"k": [false]}]}}\n</tool_call>',
        '<tool_call>{"name":"f","arguments":{"a" : 1 ,"b":[ ]}}</tool_call>',
        '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>',
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": null, "id": 7}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nDone, see above.',
        '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call> after',
        '<tool_call>{"name": "f", "arguments": {"a": 1}}',
        '<tool_call>{"name": "f", "arguments": {}}\n<tool_call>{"name": "g", "arguments": {}}',
        '<tool_call>{"name": "f", "arguments": {"raw": "line one\nline two"}}</tool_call>',
        # Not calls, found out before a call could be announced.
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
        "<tool_call>\nnot json\n</tool_call> trailing",
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>',
        '<tool_call>{"name": "f" "arguments": {}}</tool_call> then <tool_call>{"name": "g"}',
        "<tool_call>",
        '<tool_call>\n{"na',
        '\n<tool_call>\n{"name": "f", "arguments": "{"}</tool_call>\n',
    ],
    "llama3_json": [
        "",
        "Plain answer.",
        "  leading space, then text",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}',
        '{"name": "a", "parameters": {}};\n{"name": "b", "parameters": {}};',
        '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}',
        '{"type": "function", "name": "a", "parameters": {"s": "caf\\u00e9"}}',
        '{"name": "a", "parameters": {}} and some words after',
        '<|python_tag|>brave_search.call(query="weather")',
        "<|python_tag",
        # Not calls, found out before a call could be announced.
        '{"name": "Bob", "age": 3}',
        '{"result": 5}',
        '{"name": "a", "parameters": 5}',
        '{"name": "a", "parameters": {}}; {"answer": 42}',
        "{not json at all",
        '[{"name": "a", "parameters": {}}]',
    ],
    "mistral": [
        "",
        "Plain answer with [brackets] and a [TOOL prefix.",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        'Sure.\n[TOOL_CALLS] [{"name": "a", "arguments": "{\\"y\\": 2}"}]',
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}]\nThat was the call.',
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}',
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}] [TOOL_CALLS] [{"name": "b"}]',
        # Not calls, found out before a call could be announced.
        "[TOOL_CALLS] not json",
        "[TOOL_CALLS] []",
        '[TOOL_CALLS] {"name": "a", "arguments": {}}',
        '[TOOL_CALLS] [{"arguments": {}}]',
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, 3]',
        '[TOOL_CALLS] [{"name": "a", "arguments": {}} oops',
    ],
    "generic": [
        "",
        "  \n",
        "Plain answer, not the JSON object.",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        '\n { "tool_calls" :[{"name":"a","arguments":{"x":1}} , {"name": "b", "arguments": {}}]}\n',
        '{"tool_calls": [{"arguments": {"q": "x"}, "name": "search"}]}',
        '{"tool_calls": [{"name": "a", "arguments": "{\\"y\\": 2}"}, {"name": "b"}]}',
        '{"tool_calls": [{"name": "a", "arguments": {}}] } and words after',
        '{"tool_calls": [{"name": "a", "arguments": {}}]',
        '{"tool_calls": [{"name": "a", "arguments": {}}, {"bad": 1}]}',
        # Not the object, found out before anything was sent.
        '{"response": 42}',
        '{"tool_calls": []}',
        '{"tool_calls": 3}',
        '{"tool_calls": [not json]}',
        '{"tool_calls": [{"name": "a", "arguments": [1]}]}',
        '{"answer": "x"}',
        '{"tool',
        "{",
        '["tool_calls"]',
    ],
}

# Calls that break after they could be announced: the stream's content still matches.
LATE_FAILURES = {
    "hermes": [
        '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call> after',
        '<tool_call>\n{"name": "f", "arguments": {"a": "cut off \\u00',
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": 2.',
        '<tool_call>{"name": "f", "arguments": {"a": 1}, "x": }</tool_call>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
    ],
    "llama3_json": [
        '{"name": "a", "parameters": {"x": 1',
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v"',
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": "y',
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1, }}]',
    ],
    "generic": [
        '{"tool_calls": [{"name": "a", "arguments": {"x": "y',
        '{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1, }}]}',
    ],
}

CUTS = st.lists(st.integers(min_value=0, max_value=100_000), max_size=40)


def exact_cases():
    return [(name, text) for name, texts in EXACT.items() for text in texts]


def late_cases():
    return [(name, text) for name, texts in LATE_FAILURES.items() for text in texts]


@pytest.mark.parametrize(("fmt", "text"), exact_cases())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=CUTS)
def test_a_stream_split_anywhere_gives_what_parse_gives(fmt, text, cuts):
    parser = PARSERS[fmt]()
    parsed = parser.parse(text)
    content, calls = stream_pieces(parser, split(text, cuts))
    assert content == (parsed.content or "")
    # Byte for byte: the fragments join into exactly the arguments parse() reports.
    assert calls == [(call.name, call.arguments) for call in parsed.tool_calls]


@pytest.mark.parametrize(("fmt", "text"), exact_cases())
def test_a_stream_fed_one_character_at_a_time_gives_what_parse_gives(fmt, text):
    parser = PARSERS[fmt]()
    parsed = parser.parse(text)
    content, calls = stream_pieces(parser, list(text))
    assert content == (parsed.content or "")
    assert calls == [(call.name, call.arguments) for call in parsed.tool_calls]


@pytest.mark.parametrize(("fmt", "text"), exact_cases() + late_cases())
def test_every_call_has_object_arguments_and_no_text_is_lost(fmt, text):
    parsed = PARSERS[fmt]().parse(text)
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    if not parsed.tool_calls:
        assert (parsed.content or "") == text


@pytest.mark.parametrize(("fmt", "text"), late_cases())
@settings(max_examples=30, deadline=None)
@given(cuts=CUTS)
def test_a_call_that_breaks_after_it_was_announced_is_closed_and_its_text_kept(fmt, text, cuts):
    parser = PARSERS[fmt]()
    parsed = parser.parse(text)
    content, calls = stream_pieces(parser, split(text, cuts))
    assert content == (parsed.content or "")
    # The stream may have one extra, cut-short call; its arguments still parse.
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)
    expected = iter(calls)
    for call in parsed.tool_calls:
        assert (call.name, call.arguments) in expected  # parse's calls, in order


@pytest.mark.parametrize(("fmt", "text"), late_cases())
def test_a_call_that_breaks_is_content_when_parsed_whole(fmt, text):
    parsed = PARSERS[fmt]().parse(text)
    assert parsed.content and parsed.content in text


def test_hermes_text_before_the_calls_is_content_and_the_calls_are_parsed():
    parsed = HERMES.parse(EXACT["hermes"][6])
    assert parsed.content == "Let me check.\n\n"
    assert calls_of(parsed) == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {}),
    ]
    assert all(call.id.startswith("call_") for call in parsed.tool_calls)


def test_whitespace_around_calls_is_dropped_and_no_content_is_none():
    parsed = HERMES.parse('\n <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\n')
    assert parsed.content is None
    assert calls_of(parsed) == [("f", {})]


def test_text_after_a_call_is_content():
    parsed = HERMES.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.')
    assert parsed.content == "\nDone."


def test_an_output_without_calls_is_returned_unchanged():
    for parser in (HERMES, LLAMA, MISTRAL):
        assert parser.parse("  Just text.\n").content == "  Just text.\n"
        assert parser.parse("").content is None


def test_arguments_are_reserialised_like_json_dumps():
    parsed = HERMES.parse(
        '<tool_call>{"name":"f","arguments":{"b":1.50,"a":"\\u00e9\\n","c":[1,2],"d":1E2}}'
        "</tool_call>"
    )
    assert parsed.tool_calls[0].arguments == '{"b": 1.5, "a": "é\\n", "c": [1, 2], "d": 100.0}'


def test_arguments_written_as_a_json_string_are_unwrapped():
    parsed = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\":1}"}</tool_call>')
    assert parsed.tool_calls[0].arguments == '{"a": 1}'


def test_missing_or_null_arguments_become_an_empty_object():
    assert HERMES.parse('<tool_call>{"name": "f"}</tool_call>').tool_calls[0].arguments == "{}"
    parsed = MISTRAL.parse('[TOOL_CALLS][{"name": "f", "arguments": null}]')
    assert parsed.tool_calls[0].arguments == "{}"


def test_invalid_json_in_a_hermes_block_is_left_as_content():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call> bye'
    parsed = HERMES.parse(text)
    assert parsed.content == text
    assert parsed.tool_calls == []


def test_a_good_hermes_block_after_a_broken_one_is_still_found():
    text = '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call><tool_call>{"name": "g"}'
    parsed = HERMES.parse(text)
    assert calls_of(parsed) == [("g", {})]
    assert parsed.content == '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'


def test_a_hermes_block_cut_off_by_max_tokens_is_content():
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "par'
    assert HERMES.parse(text) == ParsedOutput(text, [])


def test_llama3_parameters_and_python_tag_are_understood():
    parsed = LLAMA.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b"')
    # The second call is cut off: it and what follows it are content.
    assert calls_of(parsed) == [("a", {"x": 1})]
    assert parsed.content == '; {"name": "b"'


def test_llama3_json_that_is_not_a_call_is_content():
    for text in ('{"name": "Bob", "age": 3}', '{"result": [1, 2]}', "The answer is 4."):
        assert LLAMA.parse(text).content == text
        assert LLAMA.parse(text).tool_calls == []


def test_llama3_several_calls_separated_by_semicolons():
    parsed = LLAMA.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}')
    assert parsed.content is None
    assert calls_of(parsed) == [("a", {}), ("b", {"y": 2})]


def test_mistral_text_before_the_marker_is_content():
    parsed = MISTRAL.parse('Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}]')
    assert parsed.content == "Sure. "
    assert calls_of(parsed) == [("a", {"x": 1})]


def test_mistral_broken_array_keeps_the_calls_before_the_break():
    parsed = MISTRAL.parse('[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"bad": 1}]')
    assert calls_of(parsed) == [("a", {})]
    assert parsed.content == ', {"bad": 1}]'


def test_a_partial_marker_is_held_back_and_released_when_it_is_not_one():
    stream = HERMES.stream()
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("box>") == ("<toolbox>", [])
    stream = MISTRAL.stream()
    assert stream.feed("x [TOOL") == ("x ", [])
    assert stream.finish() == ("[TOOL", [])


def test_arguments_stream_as_they_are_generated():
    stream = HERMES.stream()
    _, deltas = stream.feed('<tool_call>\n{"name": "search", "arguments": {"q": "wea')
    assert [(d.name, d.arguments) for d in deltas] == [("search", ""), (None, '{"q": "wea')]
    _, deltas = stream.feed('ther", "n": 1')
    assert [d.arguments for d in deltas] == ['ther"']  # the number is sent once it ends
    _, deltas = stream.feed("0}}\n</tool_call>")
    assert [d.arguments for d in deltas] == [', "n": 10}']
    assert stream.finish() == ("", [])


def test_a_cut_off_streamed_call_is_closed_into_valid_json():
    stream = HERMES.stream()
    stream.feed('<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "x')
    content, deltas = stream.finish()
    assert content == '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "x'
    assert json.loads(stream.tool_calls[0].arguments) == {"a": [1, {"b": "x"}]}
    assert deltas[-1].arguments == '"}]}'


def test_call_ids_look_like_openai_ids_and_differ():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


# ---------------------------------------------------------------------------------------------
# Round trips: calls written the way models write them come back as they were.

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
CALLS = st.lists(
    st.tuples(
        st.text(alphabet="abcdefghij_.-", min_size=1, max_size=12),
        st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5),
    ),
    min_size=1,
    max_size=3,
)
DUMPS_STYLES = [
    {"ensure_ascii": False},
    {"ensure_ascii": True},
    {"separators": (",", ":")},
    {"indent": 2},
]


def written(fmt: CallFormat, calls, style) -> str:
    objects = [
        fmt.call_prefix + json.dumps({"name": n, fmt.arguments_key: a}, **style) + fmt.call_suffix
        for n, a in calls
    ]
    return fmt.begin + fmt.separator.join(objects) + fmt.end


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@settings(max_examples=80, deadline=None)
@given(calls=CALLS, style=st.sampled_from(DUMPS_STYLES), cuts=CUTS)
def test_written_calls_parse_back_and_stream_back_exactly(fmt, calls, style, cuts):
    parser = PARSERS[fmt]()
    text = written(parser.call_format, calls, style)
    if style == {"ensure_ascii": False}:
        assert text == parser.call_format.render(calls)
    expected = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    parsed = parser.parse(text)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    assert stream_pieces(parser, split(text, cuts)) == ("", expected)


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
@settings(max_examples=80, deadline=None)
@given(
    before=st.text(alphabet="ab <>/_[]TOOLCAStl\n", max_size=30),
    calls=CALLS,
    cuts=CUTS,
)
def test_text_before_calls_streams_back_as_content(fmt, before, calls, cuts):
    parser = PARSERS[fmt]()
    assume(("<tool_call>" if fmt == "hermes" else "[TOOL_CALLS]") not in before)
    text = before + parser.call_format.render(calls)
    parsed = parser.parse(text)
    assert parsed.content == (before if before.strip() else None)
    assert calls_of(parsed) == [(n, json.loads(json.dumps(a))) for n, a in calls]
    content, streamed = stream_pieces(parser, split(text, cuts))
    assert content == (parsed.content or "")
    assert streamed == [(c.name, c.arguments) for c in parsed.tool_calls]


# ---------------------------------------------------------------------------------------------
# Formats and templates


def test_every_parser_is_registered_under_its_name():
    assert sorted(PARSERS) == ["generic", "hermes", "llama3_json", "mistral"]
    for name, parser in PARSERS.items():
        assert parser.name == name
        assert isinstance(parser.call_format, CallFormat)


def test_call_formats_render_what_the_models_write():
    calls = [("f", {"a": 1}), ("g", {})]
    assert HERMES.call_format.render(calls) == (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    assert MISTRAL.call_format.render(calls) == (
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    )
    assert LLAMA.call_format.render(calls) == (
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    )


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            "{%- if tools %}<tools>{{ tool | tojson }}</tools>{% endif %}"
            '{{- \'<tool_call>\\n{"name": "\' }}',
            "hermes",
        ),
        ("{%- if message.role == 'ipython' %}<|start_header_id|>ipython", "llama3_json"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ("{{- '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}", "mistral"),
        ("{{- '[TOOL_CALLS] ' + message.tool_calls|tojson }}", "mistral"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
        ("", None),
        (None, None),
    ],
)
def test_the_format_is_picked_from_the_chat_template(template, expected):
    assert parser_for_template(template) == expected
