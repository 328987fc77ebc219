"""Tool calls on a model whose chat template has no tool-call format (SmolLM2's own template),
through the generic format, with the official openai SDK.

One `pyserve run` server for the module on a tiny random-weight model (tests/http_testlib.py
`tiny_model`). A random model writes nonsense, so what must parse is what the grammar forces:
under `required` or a named tool the calls, under `auto` either calls or a reply object. The
schemas are bounded, so every call ends within max_tokens.
"""

from __future__ import annotations

import json

import pytest
from http_testlib import running_server, tiny_model
from openai import BadRequestError
from pydantic import BaseModel
from test_structured_outputs import TOOLS

MAX_TOKENS = 512

ARGUMENT_KEYS = {"get_weather": {"city", "unit"}, "get_time": {"zone"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Verdict(BaseModel):
    ok: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory.getbasetemp())
    template = (model / "chat_template.jinja").read_text()
    assert "tool" not in template  # SmolLM2's own template: no format of its own
    args = ["--model", str(model), "--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def check_calls(message) -> list[tuple[str, dict]]:
    calls = calls_of(message)
    assert calls
    for call, (name, arguments) in zip(message.tool_calls, calls, strict=True):
        assert call.id.startswith("call_") and call.type == "function"
        assert set(arguments) == ARGUMENT_KEYS[name]
    assert message.content is None
    return calls


def sampling(seed: int | None) -> dict:
    return {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}


@pytest.mark.parametrize("seed", [None, 5])
def test_required_always_calls_a_tool(client, model_id, seed) -> None:
    completion = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        **sampling(seed),
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message)


def test_a_named_tool_is_called_exactly_once(client, model_id) -> None:
    completion = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    calls = check_calls(completion.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"]
    assert completion.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_means_one_call(client, model_id) -> None:
    for seed in range(3):
        completion = client.chat.completions.create(
            model=model_id,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        assert len(check_calls(completion.choices[0].message)) == 1


def streamed(client, body: dict) -> tuple[list[str], dict[int, dict], str | None]:
    """(content deltas, calls by index, finish reason) of a streamed request; checks that each
    call's first delta carries its id and name and the later ones only arguments."""
    contents: list[str] = []
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            contents.append(choice.delta.content)
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function"
                assert delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and not delta.function.name
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return contents, calls, finish


@pytest.mark.parametrize("seed", [None, 11])
def test_streamed_calls_assemble_to_the_whole_response(client, model_id, seed) -> None:
    body = dict(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        **sampling(seed),
    )
    whole = client.chat.completions.create(**body).choices[0]
    contents, calls, finish = streamed(client, body)
    assert finish == "tool_calls" and not contents
    assembled = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert assembled == calls_of(whole.message)


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_auto_answers_with_a_reply_or_calls_and_streams_the_same(client, model_id, seed) -> None:
    body = dict(model=model_id, messages=ASK, tools=TOOLS, max_tokens=48, **sampling(seed))
    plain = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=1)
    whole = client.chat.completions.create(**body)
    # The tools' definitions and the instructions are in the prompt.
    assert whole.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    choice = whole.choices[0]
    contents, calls, finish = streamed(client, body)
    assert finish == choice.finish_reason
    if choice.message.tool_calls:
        if choice.finish_reason != "length":  # the last call may be cut off
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message)
        return
    # A reply: its decoded string is the content, never the JSON around it.
    content = choice.message.content
    assert isinstance(content, str) and not content.startswith('{"response"')
    assert "".join(contents) == content and not calls
    if len(content) > 8:
        assert len(contents) > 1  # streamed as it was generated, not at the end


def test_auto_with_a_response_format_answers_with_calls_or_the_json(client, model_id) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=model_id,
            messages=ASK,
            tools=TOOLS,
            response_format=Verdict,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        message = completion.choices[0].message
        if message.tool_calls:
            assert completion.choices[0].finish_reason == "tool_calls"
            check_calls(message)
        else:
            assert isinstance(message.parsed, Verdict)


def test_a_conversation_with_calls_and_results_renders_and_answers(client, model_id) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": json.dumps({"city": "Paris", "unit": "celsius"}),
                    },
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    for choice in ("auto", "none", "required"):
        completion = client.chat.completions.create(
            model=model_id,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=MAX_TOKENS if choice == "required" else 8,
            temperature=0,
        )
        message = completion.choices[0].message
        if choice == "required":
            check_calls(message)
        else:
            assert message.tool_calls or message.content is not None
    shorter = client.chat.completions.create(
        model=model_id, messages=messages[:2], tools=TOOLS, max_tokens=1, temperature=0
    )
    # The calls and their results are in the prompt.
    assert completion.usage.prompt_tokens > shorter.usage.prompt_tokens + 40


def test_tool_choice_none_renders_no_tools_and_the_text_is_content(client, model_id) -> None:
    plain = client.chat.completions.create(
        model=model_id, messages=ASK, max_tokens=8, temperature=0
    )
    none = client.chat.completions.create(
        model=model_id, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls


# A schema the grammar engine cannot enforce (uniqueItems), as agents' tools sometimes have.
TAGS = {
    "type": "function",
    "function": {
        "name": "set_tags",
        "parameters": {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
            },
        },
    },
}


def test_a_tool_whose_schema_cannot_be_enforced_is_called_with_any_object(
    server, client, model_id
) -> None:
    completion = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=[*TOOLS, TAGS],
        tool_choice={"type": "function", "function": {"name": "set_tags"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )  # not a 400: the call is held to a JSON object of arguments
    choice = completion.choices[0]
    if choice.finish_reason == "tool_calls":  # a random model may write past max_tokens
        [(name, arguments)] = calls_of(choice.message)
        assert name == "set_tags" and isinstance(arguments, dict)
    assert any("'set_tags': its calls are held to any JSON object" in x for x in server.lines)
    strict = {"type": "function", "function": {**TAGS["function"], "strict": True}}
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(
            model=model_id, messages=ASK, tools=[strict], tool_choice="required", max_tokens=8
        )
    assert info.value.body["param"] == "tools[0].function.parameters"
    assert "uniqueItems" in info.value.body["message"]
