"""gpt-oss's harmony format: outputs read back as reasoning_content, content and tool_calls
(whole and streamed), the model found by its tokenizer, histories rendered through its real
chat template, the grammars that force its calls, and all of it through the HTTP routes and
the openai SDK on a scripted engine (harmony_testlib)."""

from __future__ import annotations

import asyncio
import itertools
import json

import msgspec
import pytest
from chat_testlib import openai_message, openai_stream
from harmony_testlib import VOCAB_SIZE, ScriptedEngine, harmony_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from pyserve.chat.harmony import HarmonyFormat
from pyserve.chat.harmony_grammar import answer_after_thought, calls_lark
from pyserve.chat.harmony_prompt import HarmonyPrompt, template_tools
from pyserve.chat.output import ChatOutput
from pyserve.chat.policy import ChatPolicy
from pyserve.grammars import grammar_problem, llguidance_grammar
from pyserve.http.protocol import ChatMessage
from pyserve.wire.main_to_worker import Grammar

OUTPUT = ChatOutput(harmony=HarmonyFormat())
NEXT = "<|end|><|start|>assistant"  # between two messages of one turn
THINK = "<|channel|>analysis<|message|>The user wants the weather in Paris."
FINAL = "<|channel|>final<|message|>It is sunny in Paris."
HEADER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
CALL = HEADER + '{"location":"Paris"}'
CALL_FIRST = ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


# ------------------------------------------------------------------ whole outputs


def test_a_final_message_is_the_content() -> None:
    message, finish = openai_message(OUTPUT, FINAL, "stop")
    assert message == {"role": "assistant", "content": "It is sunny in Paris."}
    assert finish == "stop"


def test_the_analysis_channel_is_the_reasoning() -> None:
    message, finish = openai_message(OUTPUT, THINK + NEXT + FINAL, "stop")
    assert message["reasoning_content"] == "The user wants the weather in Paris."
    assert message["content"] == "It is sunny in Paris."
    assert finish == "stop"


def test_a_message_to_a_function_is_a_tool_call() -> None:
    message, finish = openai_message(OUTPUT, THINK + NEXT + CALL, "stop")
    assert message["reasoning_content"] == "The user wants the weather in Paris."
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert calls_of(message) == [("get_weather", '{"location":"Paris"}')]
    assert finish == "tool_calls"


def test_the_recipient_may_come_before_the_channel_and_calls_may_follow_each_other() -> None:
    text = CALL_FIRST + "<|call|><|start|>assistant" + CALL + "<|call|>"
    message, finish = openai_message(OUTPUT, text, "stop")
    assert calls_of(message) == [
        ("get_time", '{"zone": "CET"}'),
        ("get_weather", '{"location":"Paris"}'),
    ]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert message["content"] is None and "reasoning_content" not in message
    assert finish == "tool_calls"


def test_a_preamble_is_content_beside_the_call() -> None:
    preamble = "<|channel|>commentary<|message|>Let me look that up."
    message, finish = openai_message(OUTPUT, THINK + NEXT + preamble + NEXT + CALL, "stop")
    assert message["content"] == "Let me look that up."
    assert calls_of(message) == [("get_weather", '{"location":"Paris"}')]
    assert finish == "tool_calls"


def test_messages_of_one_kind_join_and_built_in_tools_are_reasoning() -> None:
    browse = '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}'
    text = THINK + NEXT + browse + NEXT + "<|channel|>analysis<|message|>Found." + NEXT + FINAL
    message, _ = openai_message(OUTPUT, text + "<|return|>", "stop")
    assert message["reasoning_content"] == (
        'The user wants the weather in Paris.\n\n{"query": "x"}\n\nFound.'
    )
    assert message["content"] == "It is sunny in Paris."


def test_a_function_without_arguments_gets_an_empty_object() -> None:
    text = "<|channel|>commentary to=functions.now <|constrain|>json<|message|><|call|>"
    message, _ = openai_message(OUTPUT, text, "stop")
    assert calls_of(message) == [("now", "{}")]


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [
        # cut off in the thought, in the next header, in a call's arguments
        ("<|channel|>analysis<|message|>The user wa", "The user wa", None, []),
        (THINK + "<|end|><|start|>assistant", "The user wants the weather in Paris.", None, []),
        (THINK + NEXT + "<|channel|>fin", "The user wants the weather in Paris.", None, []),
        (CALL[:-9], None, None, [("get_weather", '{"location"')]),
        ("<|channel|>final<|message|>It is sun", None, "It is sun", []),
        # a header cut off before its first marker
        (" to=functions.get_wea", None, None, []),
    ],
)
def test_a_cut_off_output_keeps_what_it_has_in_its_place(text, reasoning, content, calls) -> None:
    message, finish = openai_message(OUTPUT, text, "length")
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == (content if content or calls or reasoning else "")
    assert (calls_of(message) if calls else message.get("tool_calls")) == (calls or None)
    assert finish == "length"


def test_malformed_outputs_never_leak_markup_or_raise() -> None:
    plain, _ = openai_message(OUTPUT, "Hello, I wrote no harmony at all.", "stop")
    assert plain["content"] == "Hello, I wrote no harmony at all."
    # a stray marker in a body is dropped; a message that never ended ends at the next one
    text = "<|channel|>final<|message|>A<|constrain|>B<|channel|>final<|message|>C"
    message, _ = openai_message(OUTPUT, text, "stop")
    assert message["content"] == "AB\n\nC"
    # a header without a body is dropped
    text = "<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>D<|return|>"
    assert openai_message(OUTPUT, text, "stop")[0]["content"] == "D"


def test_without_tools_a_call_is_content() -> None:
    output = ChatOutput(harmony=HarmonyFormat(calls=False))
    message, finish = openai_message(output, CALL, "stop")
    assert message == {"role": "assistant", "content": '{"location":"Paris"}'}
    assert finish == "stop"


# ------------------------------------------------------------------ streaming

STREAMED = [
    THINK + NEXT + FINAL,
    THINK + NEXT + "<|channel|>commentary<|message|>Checking." + NEXT + CALL,
    CALL_FIRST + "<|call|><|start|>assistant" + CALL,
    "<|channel|>analysis<|message|>a <|en dash <| x" + NEXT + FINAL + " é ü",
    "Plain text, no harmony",
]


def assembled(choices: list[dict]) -> tuple[dict, str | None]:
    """The whole message that a stream's choice entries add up to, and its finish reason."""
    reasoning = "".join(c["delta"].get("reasoning_content", "") for c in choices)
    content = "".join(c["delta"].get("content") or "" for c in choices)
    calls: dict[int, list[str]] = {}
    for choice in choices:
        for call in choice["delta"].get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["function"]["arguments"] == ""
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    for choice in choices:
        assert not any(m in json.dumps(choice["delta"]) for m in ("<|message|>", "<|channel|>"))
    message = {"reasoning": reasoning or None, "content": content or None}
    message["calls"] = [tuple(calls[i]) for i in sorted(calls)]
    return message, choices[-1]["finish_reason"]


def whole(text: str, finish: str) -> tuple[dict, str | None]:
    message, reason = openai_message(OUTPUT, text, finish)
    return {
        "reasoning": message.get("reasoning_content"),
        "content": message["content"] or None,
        "calls": calls_of(message) if "tool_calls" in message else [],
    }, reason


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(len(STREAMED))), st.lists(st.integers(0, 200), max_size=16))
def test_streamed_deltas_assemble_to_the_whole_message(which: int, cuts: list[int]) -> None:
    text = STREAMED[which]
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for finish in ("stop", "length"):
        assert assembled(openai_stream(OUTPUT, pieces, finish)) == whole(text, finish)


def test_a_call_streams_its_name_first_then_its_arguments() -> None:
    at = len(HEADER)
    pieces = [THINK, NEXT, CALL[:40], CALL[40:at], CALL[at : at + 5], CALL[at + 5 :]]
    choices = openai_stream(OUTPUT, pieces, "stop")
    entries = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert entries[0]["id"].startswith("call_")
    later = [call["function"] for call in entries[1:]]
    assert [f["arguments"] for f in later] == ['{"loc', 'ation":"Paris"}']
    assert all("name" not in f for f in later)
    assert choices[-1]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------ the model and its policy


def test_a_harmony_tokenizer_needs_no_flag(tokenizer) -> None:
    policy = ChatPolicy(tokenizer, "auto", None)
    assert policy.harmony and policy.harmony_calls and policy.reads_thoughts
    assert policy.tool_call_parser is None and policy.reasoning_parser is None
    assert policy.turn_end_ids == [200002, 200012]
    assert policy.special_tokens["<|channel|>"] == 200005
    assert not ChatPolicy(tokenizer, "none", None).harmony_calls


def test_harmony_is_chosen_by_name_and_other_formats_stay_theirs(tokenizer) -> None:
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    )
    other = harmony_tokenizer(chatml)  # the vocabulary alone does not make the format
    assert not ChatPolicy(other, "auto", None).harmony
    assert ChatPolicy(other, "harmony", None).harmony
    assert ChatPolicy(other, "auto", "harmony").harmony
    assert not ChatPolicy(tokenizer, "hermes", None).harmony


# ------------------------------------------------------------------ rendering histories


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    parsed = msgspec.convert(messages, list[ChatMessage])
    shaped = HarmonyPrompt().messages([m.as_template_input() for m in parsed])
    return tokenizer.apply_chat_template(
        shaped,
        tools=template_tools(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two tools to call.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_b", "content": "14:00"},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
]


def test_a_history_of_calls_and_results_renders_as_harmony(tokenizer) -> None:
    text = render(tokenizer, HISTORY, [WEATHER, TIME], reasoning_effort="high")
    assert "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in text
    assert "type get_weather = (_: {\nlocation: string,\n}) => any;" in text
    assert "// \ntype get_time" in text  # a tool without a description
    assert text.endswith(
        "<|start|>user<|message|>Weather and time in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Two tools to call.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"location": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"sunny"<|end|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        '{"zone": "CET"}<|call|>'
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"
        '"14:00"<|end|>'
        "<|start|>assistant"
    )


def test_a_thought_given_as_reasoning_and_a_preamble_render_as_the_calls_analysis(
    tokenizer,
) -> None:
    history = [dict(m) for m in HISTORY[:3]]
    history[2].update(reasoning_content=None, reasoning="Thinking.", content="Checking.")
    history[2]["tool_calls"] = history[2]["tool_calls"][:1]
    history.append({"role": "tool", "tool_call_id": "call_a", "content": "sunny"})
    text = render(tokenizer, history, [WEATHER])
    assert "<|channel|>analysis<|message|>Thinking.\n\nChecking.<|end|>" in text
    assert "Reasoning: medium" in text  # the template's default


def test_earlier_final_answers_drop_their_thought(tokenizer) -> None:
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    text = render(tokenizer, history)
    assert "Greet back." not in text  # as gpt-oss was trained: earlier thoughts are dropped
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text


# ------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def matcher_tokenizer(tokenizer):
    from llguidance import LLTokenizer

    return LLTokenizer(
        tokenizer.backend_tokenizer.to_str(), n_vocab=VOCAB_SIZE, eos_token=[200002, 200012]
    )


def accepts(matcher_tokenizer, tokenizer, grammar: Grammar, text: str) -> bool:
    from llguidance import LLMatcher

    assert grammar_problem(grammar) is None
    matcher = LLMatcher(matcher_tokenizer, llguidance_grammar(grammar), log_level=0)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_a_forced_call_grammar_writes_what_the_reader_reads(matcher_tokenizer, tokenizer) -> None:
    tools = [("get_weather", WEATHER["function"]["parameters"]), ("get_time", None)]
    grammar = Grammar("lark", calls_lark(tools, {**tokenizer.get_added_vocab()}))
    call = HEADER + '{"location": "Paris"}'
    for text in (call, THINK + NEXT + call):
        assert accepts(matcher_tokenizer, tokenizer, grammar, text), text
        message, _ = openai_message(OUTPUT, text, "stop")
        assert calls_of(message) == [("get_weather", '{"location": "Paris"}')]
    assert not accepts(matcher_tokenizer, tokenizer, grammar, call.replace("get_weather", "nope"))
    assert not accepts(matcher_tokenizer, tokenizer, grammar, FINAL)


def test_an_answer_format_applies_to_the_final_message(matcher_tokenizer, tokenizer) -> None:
    added = tokenizer.get_added_vocab()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = answer_after_thought(Grammar("json_schema", json.dumps(schema)), added)
    final = '<|channel|>final<|message|>{"a": 1}'
    for text in (final, THINK + NEXT + final):
        assert accepts(matcher_tokenizer, tokenizer, answer, text), text
    assert not accepts(matcher_tokenizer, tokenizer, answer, '{"a": 1}')
    either = Grammar(
        "lark", calls_lark([("get_time", None)], added, answer=True, answer_schema=schema)
    )
    assert accepts(matcher_tokenizer, tokenizer, either, THINK + NEXT + final)
    call = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}'
    assert accepts(matcher_tokenizer, tokenizer, either, call)


# ------------------------------------------------------------------ through HTTP and the SDK


async def _with_client(engine: ScriptedEngine, body):
    from aiohttp.test_utils import TestServer
    from openai import AsyncOpenAI

    from pyserve.http.app import create_app

    server = TestServer(create_app(engine, web_ui=False))
    await server.start_server()
    try:
        client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="none", max_retries=0)
        async with client:
            return await body(client)
    finally:
        await server.close()
        engine.close()


def serve(tokenizer, script: str, body, **config):
    engine = ScriptedEngine(tokenizer, script, **config)
    return engine, asyncio.run(_with_client(engine, body))


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_http_a_thought_and_an_answer_come_back_apart(tokenizer) -> None:
    async def body(client):
        return await client.chat.completions.create(
            model="gpt-oss-scripted", messages=ASK, reasoning_effort="low"
        )

    engine, completion = serve(tokenizer, THINK + NEXT + FINAL + "<|return|>", body)
    choice = completion.choices[0]
    assert choice.message.content == "It is sunny in Paris."
    assert choice.message.reasoning_content == "The user wants the weather in Paris."
    assert choice.finish_reason == "stop"
    [(prompt, sampling, detok)] = engine.requests
    assert not detok.skip_special_tokens  # the reader needs the markers
    assert {200002, 200012} <= set(sampling.stop_token_ids)
    rendered = tokenizer.decode(prompt)
    assert "Reasoning: low" in rendered and rendered.endswith("<|start|>assistant")


def test_http_a_call_comes_back_as_tool_calls_whole_and_streamed(tokenizer) -> None:
    script = THINK + NEXT + CALL + "<|call|>"

    async def body(client):
        whole = await client.chat.completions.create(
            model="gpt-oss-scripted", messages=ASK, tools=[WEATHER]
        )
        stream = await client.chat.completions.create(
            model="gpt-oss-scripted", messages=ASK, tools=[WEATHER], stream=True
        )
        return whole, [chunk async for chunk in stream]

    engine, (whole, chunks) = serve(tokenizer, script, body)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "The user wants the weather in Paris."
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"location":"Paris"}')
    assert call.id.startswith("call_")

    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "The user wants the weather in Paris."
    assert not "".join(d.content or "" for d in deltas)
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert streamed[0].function.name == "get_weather" and streamed[0].id.startswith("call_")
    assert "".join(t.function.arguments or "" for t in streamed) == '{"location":"Paris"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    rendered = tokenizer.decode(engine.requests[0][0])
    assert "namespace functions {" in rendered and "type get_weather" in rendered


def test_http_a_forced_call_is_held_by_harmonys_grammar(tokenizer) -> None:
    async def body(client):
        return await client.chat.completions.create(
            model="gpt-oss-scripted",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )

    engine, completion = serve(tokenizer, CALL + "<|call|>", body)
    assert completion.choices[0].finish_reason == "tool_calls"
    grammar = engine.requests[0][1].grammar
    assert grammar.kind == "lark" and "to=functions.get_weather " in grammar.text
    assert "get_time" not in grammar.text and "<[200005]>" in grammar.text


def test_http_a_history_with_calls_and_results_reaches_the_template(tokenizer) -> None:
    async def body(client):
        return await client.chat.completions.create(
            model="gpt-oss-scripted",
            messages=HISTORY,
            tools=[WEATHER, TIME],
            reasoning_effort="high",
        )

    engine, completion = serve(tokenizer, FINAL + "<|return|>", body)
    assert completion.choices[0].message.content == "It is sunny in Paris."
    rendered = tokenizer.decode(engine.requests[0][0])
    assert rendered == render(tokenizer, HISTORY, [WEATHER, TIME], reasoning_effort="high")


def test_http_an_effort_gpt_oss_does_not_know_is_refused(tokenizer) -> None:
    import openai

    async def body(client):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="gpt-oss-scripted", messages=ASK, reasoning_effort="minimal"
            )
        return caught.value

    engine, error = serve(tokenizer, FINAL, body)
    assert error.body["param"] == "reasoning_effort" and not engine.requests


def test_http_a_cut_off_answer_keeps_what_it_has(tokenizer) -> None:
    async def body(client):
        return await client.chat.completions.create(
            model="gpt-oss-scripted", messages=ASK, max_tokens=60
        )

    script = THINK + NEXT + FINAL
    _, completion = serve(tokenizer, script, body)
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.reasoning_content.startswith("The user wants")
    assert "<|" not in (choice.message.content or "") + choice.message.reasoning_content


def test_http_anthropic_messages_read_the_channels_and_take_a_thought_request(tokenizer) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from pyserve.http.app import create_app

    engine = ScriptedEngine(tokenizer, THINK + NEXT + CALL + "<|call|>")

    async def run() -> dict:
        app = create_app(engine, web_ui=False)
        async with TestClient(TestServer(app)) as client:
            response = await client.post(
                "/v1/messages",
                json={
                    "model": "gpt-oss-scripted",
                    "max_tokens": 2048,
                    "messages": ASK,
                    "thinking": {"type": "enabled", "budget_tokens": 1024},
                    "tools": [
                        {
                            "name": "get_weather",
                            "description": "The weather in a city.",
                            "input_schema": WEATHER["function"]["parameters"],
                        }
                    ],
                },
            )
            assert response.status == 200, await response.text()
            return await response.json()

    try:
        body = asyncio.run(run())
    finally:
        engine.close()
    kinds = [block["type"] for block in body["content"]]
    assert kinds == ["thinking", "tool_use"], body
    assert body["content"][0]["thinking"] == "The user wants the weather in Paris."
    assert body["content"][1]["name"] == "get_weather"
    assert body["content"][1]["input"] == {"location": "Paris"}
    assert body["stop_reason"] == "tool_use"
