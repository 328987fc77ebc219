"""Structured outputs, tool calls, logit_bias and refused fields through the official openai SDK.

One `pyserve run` server for the module, on a tiny random-weight model with SmolLM2's tokenizer
and a Hermes-style chat template written here (so the tool-call format is found from the
template). A random model writes nonsense, so everything that must parse is forced by the
grammar; the schemas are bounded (maxLength, maximum, maxItems), so every document ends within
max_tokens.
"""

from __future__ import annotations

import json
import shutil
from typing import Literal

import pytest
import requests
from http_testlib import running_server, tiny_model
from openai import BadRequestError
from pydantic import BaseModel, Field

MODEL = "structured-model"
MAX_TOKENS = 1024  # more than the longest document any schema here allows

# A template of our own in the Hermes format: tools listed in the system turn, calls written as
# <tool_call> blocks, tool results given back as <tool_response> user turns.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=130)
    role: Literal["admin", "user", "guest"]
    active: bool
    address: Address


class Inventory(BaseModel):
    items: list[Address] = Field(max_length=3)
    tags: list[Literal["new", "used", "broken"]] = Field(max_length=4)
    count: int = Field(ge=-5, le=5)


class Flags(BaseModel):
    a: bool
    b: bool | None
    level: Literal[1, 2, 3]


SCHEMAS = [Person, Inventory, Flags]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    source = tiny_model(tmp_path_factory.getbasetemp())
    directory = tmp_path_factory.mktemp("structured") / MODEL
    shutil.copytree(source, directory)
    (directory / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--model", str(model_dir), "--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server


def sampling(seed: int | None) -> dict:
    """Greedy, or a seeded draw at temperature 1 (random choices inside the grammar)."""
    return {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}


# ----------------------------------------------------------------------------- response_format


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_parse_always_returns_the_pydantic_model(client, schema, seed) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe one as JSON."}],
        response_format=schema,
        max_tokens=MAX_TOKENS,
        **sampling(seed),
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, schema)


def test_json_object_is_any_json_object(client) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,
    )
    text = completion.choices[0].message.content
    assert text.startswith("{")
    if completion.choices[0].finish_reason == "stop":  # any object: a random one may run long
        assert isinstance(json.loads(text), dict)


def test_streamed_json_equals_the_whole_response(client) -> None:
    body = dict(
        model=MODEL,
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "flags", "schema": Flags.model_json_schema()},
        },
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    whole = client.chat.completions.create(**body).choices[0].message.content
    stream = client.chat.completions.create(**body, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole
    Flags.model_validate_json(whole)


def test_sglang_grammar_fields_on_generate_and_completions(server, client) -> None:
    url = server.url + "/generate"
    cases = [
        ("regex", r"[0-9]{3}-[0-9]{4}"),
        ("ebnf", 'root ::= "yes" | "no"'),
        ("json_schema", json.dumps(Flags.model_json_schema())),
    ]
    for field, spec in cases:
        params = {field: spec, "max_new_tokens": MAX_TOKENS, "temperature": 0}
        out = requests.post(url, json={"text": "Answer:", "sampling_params": params}, timeout=120)
        assert out.status_code == 200, out.text
        text = out.json()["text"]
        assert out.json()["meta_info"]["finish_reason"]["type"] == "stop"
        if field == "regex":
            assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()
        elif field == "ebnf":
            assert text in ("yes", "no")
        else:
            Flags.model_validate_json(text)
    legacy = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=32, temperature=0, extra_body={"regex": "[A-Z]{4}"}
    )
    assert len(legacy.choices[0].text) == 4 and legacy.choices[0].text.isupper()


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
            "foo",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems",
        ),
        ({"regex": "[a-"}, "regex", "unclosed"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "at most one"),
    ],
)
def test_unusable_constraints_get_a_400_naming_the_field(server, body, param, words) -> None:
    payload = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    out = requests.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == param and words in error["message"]


# ----------------------------------------------------------------------------- tools


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("seed", [None, 3])
def test_required_tool_choice_always_calls_a_tool(client, seed) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        **sampling(seed),
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = calls_of(choice.message)
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    for call, (name, arguments) in zip(choice.message.tool_calls, calls, strict=True):
        assert call.id.startswith("call_") and call.type == "function"
        expected = {"get_weather": {"city", "unit"}, "get_time": {"zone"}}[name]
        assert set(arguments) == expected


def test_a_named_tool_choice_calls_exactly_that_tool_once(client) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    calls = calls_of(completion.choices[0].message)
    assert len(calls) == 1 and calls[0][0] == "get_time"
    assert completion.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_means_one_call(client) -> None:
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        assert len(completion.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_assemble_to_the_whole_response(client) -> None:
    body = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    whole = client.chat.completions.create(**body).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # the first delta of a call: id, type and name
                assert delta.id.startswith("call_") and delta.type == "function"
                assert delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and not delta.function.name
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert streamed == calls_of(whole.message)


def test_auto_renders_the_tools_and_a_plain_answer_stays_content(client) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tools' definitions
    message = auto.choices[0].message
    assert not message.tool_calls and message.content  # a random model calls nothing
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_auto_with_a_response_format_answers_with_calls_or_the_json(client) -> None:
    for seed in range(4):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            response_format=Flags,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        message = completion.choices[0].message
        if message.tool_calls:
            assert completion.choices[0].finish_reason == "tool_calls"
            assert calls_of(message)
        else:
            assert isinstance(message.parsed, Flags)


def test_a_conversation_with_tool_calls_and_results_is_rendered(client) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert completion.choices[0].message.content is not None
    shorter = client.chat.completions.create(
        model=MODEL, messages=messages[:1], tools=TOOLS, max_tokens=4, temperature=0
    )
    assert completion.usage.prompt_tokens > shorter.usage.prompt_tokens + 15


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "regex"),
    ],
)
def test_bad_tool_requests_get_a_400(server, body, param) -> None:
    payload = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    out = requests.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert out.status_code == 400, out.text
    if param is not None:
        assert out.json()["error"]["param"].startswith(param)


# ----------------------------------------------------------------------------- logit_bias


def test_logit_bias_bans_and_forces_tokens(server, client) -> None:
    def generate(**params) -> list[int]:
        params.update(max_new_tokens=6, temperature=0, ignore_eos=True)
        body = {"text": "Once upon a time", "sampling_params": params}
        return requests.post(server.url + "/generate", json=body, timeout=60).json()["output_ids"]

    free = generate()
    banned = generate(logit_bias={str(free[0]): -100})
    assert free[0] not in banned
    forced = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        logit_bias={"28": 100},
        extra_body={"ignore_eos": True},
    )
    detokenized = requests.post(server.url + "/detokenize", json={"tokens": [28] * 6}, timeout=30)
    assert forced.choices[0].text == detokenized.json()["prompt"]


def test_logit_bias_outside_the_vocabulary_is_a_400(client) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, logit_bias={"49152": 5}
        )
    assert caught.value.body["param"] == "logit_bias"
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, logit_bias={"5": 101}
        )


# ----------------------------------------------------------------------------- refused fields


@pytest.mark.parametrize(
    "field, value",
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("verbosity", "low"),
        ("web_search_options", {}),
        ("service_tier", "flex"),
        ("reasoning_effort", "low"),  # this template reads no reasoning_effort
    ],
)
def test_each_unimplemented_chat_field_is_refused_by_name(server, field, value) -> None:
    payload = {"model": MODEL, "messages": ASK, "max_tokens": 2, field: value}
    out = requests.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported_parameter")


def test_image_content_is_refused(server) -> None:
    content = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    out = requests.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert out.status_code == 400
    assert "image_url" in out.json()["error"]["message"]


def test_fields_that_change_nothing_are_accepted_and_unknown_ones_warned_once(server) -> None:
    payload = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 2,
        "user": "u",
        "metadata": {"k": "v"},
        "store": False,
        "safety_identifier": "s",
        "prompt_cache_key": "p",
        "service_tier": "auto",
        "modalities": ["text"],
        "some_vendor_knob": 3,
    }
    for _ in range(2):
        out = requests.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
        assert out.status_code == 200, out.text
    warnings = [line for line in server.lines if "some_vendor_knob" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]
