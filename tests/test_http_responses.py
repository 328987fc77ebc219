"""The Responses API through the official openai SDK against a real `pyserve run`.

A tiny random-weight model (tests/http_testlib.py) with SmolLM2's template, so tools go through
the generic format; what must parse is forced by a grammar (a required or named call, a
`text.format` schema) and the schemas are bounded, so outputs end. Reasoning items come from a
copy of it whose template opens a thought, served with `--reasoning-parser deepseek_r1`. Stored
responses live in each server's own `--state-dir`; one test restarts a server on the same
directory and continues the conversation there.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import openai
import pytest
from http_testlib import (
    kv_idle,
    metrics,
    openai_client,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)
from pydantic import BaseModel, Field
from test_responses_format import FAILED, ORDER

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris?"
MAX = 400  # output tokens: more than the longest call or object the bounded schemas allow


class Verdict(BaseModel):
    ok: bool
    label: str = Field(max_length=8)


def base_args(model, state_dir) -> list[str]:
    return [
        "--model", str(model), "--torch-threads", "1", "--tokenizer-workers", "1",
        "--state-dir", str(state_dir),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("responses") / "state"


@pytest.fixture(scope="module")
def server(model, state_dir):
    with running_server(base_args(model, state_dir)) as server:
        yield server


def names(events) -> str:
    return " ".join(e.type.removeprefix("response.") for e in events)


def check_stream(events) -> None:
    order = names(events)
    assert ORDER.fullmatch(order) or FAILED.fullmatch(order), order
    assert [e.sequence_number for e in events] == list(range(len(events)))


# ----------------------------------------------------------------------------- create


def test_a_text_answer_has_one_message_usage_and_cached_tokens(client) -> None:
    kwargs = dict(input="Tell me a story.", instructions="Be brief.", max_output_tokens=6)
    first = client.responses.create(temperature=0, **kwargs)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens"
    [message] = first.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "incomplete"
    assert first.output_text and first.instructions == "Be brief."
    assert first.usage.output_tokens == 6 and first.usage.input_tokens > 10
    again = client.responses.create(temperature=0, **kwargs)
    assert again.output_text == first.output_text
    assert again.usage.input_tokens == first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > 0  # the prefix cache's


def test_parse_returns_the_schemas_object(client) -> None:
    response = client.responses.parse(
        input="Is it fine?", text_format=Verdict, max_output_tokens=MAX
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Verdict)
    assert response.text.format.type == "json_schema"


def test_a_stream_follows_openais_event_order(client) -> None:
    events = list(
        client.responses.create(
            input="Hi", max_output_tokens=5, stream=True, metadata={"k": "v"}, user="u1"
        )
    )
    check_stream(events)
    final = events[-1].response
    assert final.status == "incomplete" and final.metadata == {"k": "v"} and final.user == "u1"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    model = client.models.list().data[0].id  # the stream helper wants one
    with client.responses.stream(
        model=model, input="Ok?", text_format=Verdict, max_output_tokens=MAX
    ) as s:
        streamed = list(s)
        parsed = s.get_final_response()
    check_stream(streamed)
    assert streamed[-1].type == "response.completed"
    assert isinstance(parsed.output_parsed, Verdict)


# ----------------------------------------------------------------------------- function calls


def calls(response) -> list:
    found = [item for item in response.output if item.type == "function_call"]
    for item in found:
        assert item.id.startswith("fc_") and item.call_id.startswith("call_")
        assert item.status == "completed"
        arguments = json.loads(item.arguments)
        assert set(arguments) == {"get_weather": {"city", "unit"}, "get_time": {"zone"}}[item.name]
    return found


def test_a_function_call_round_trip_by_previous_response_id_and_by_full_input(client) -> None:
    first = client.responses.create(
        input=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
        max_output_tokens=MAX,
    )  # fmt: skip
    assert first.status == "completed"
    made = calls(first)
    assert made and first.output_text == ""
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 21}'}
        for c in made
    ]
    follow = dict(tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_time"})
    by_id = client.responses.create(
        previous_response_id=first.id, input=results, temperature=0, max_output_tokens=MAX,
        **follow,
    )  # fmt: skip
    assert by_id.previous_response_id == first.id
    [named] = calls(by_id)
    assert named.name == "get_time"
    # The same conversation sent whole: the model sees the same prompt and answers the same.
    replay = [{"role": "user", "content": ASK}, *[c.model_dump() for c in made], *results]
    whole = client.responses.create(input=replay, temperature=0, max_output_tokens=MAX, **follow)
    assert whole.usage.input_tokens == by_id.usage.input_tokens
    assert [(c.name, c.arguments) for c in calls(whole)] == [(named.name, named.arguments)]
    # What the stored response keeps: its own input items; its output; delete, then 404.
    items = client.responses.input_items.list(by_id.id, order="asc").data
    assert [i.type for i in items] == ["function_call_output"] * len(results)
    assert all(i.id for i in items)
    assert client.responses.retrieve(by_id.id).output[0].call_id == named.call_id
    client.responses.delete(by_id.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(by_id.id)
    assert caught.value.body["code"] == "response_not_found"


def test_streamed_function_call_arguments_add_up(client) -> None:
    events = list(
        client.responses.create(
            input=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
            max_output_tokens=MAX, stream=True,
        )
    )  # fmt: skip
    check_stream(events)
    final = events[-1].response
    [call] = calls(final)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.item_id == call.id


def test_store_false_keeps_nothing_and_the_store_is_private(client, state_dir) -> None:
    response = client.responses.create(input="x", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state_dir / "responses.sqlite3").st_mode) == 0o600


# ----------------------------------------------------------------------------- bad input

BAD = [
    (b"{not json", None),
    ({"input": []}, "input"),
    ({"input": [{"type": "nope"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "what", "text": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "model": "another-model"}, "model"),
]  # fmt: skip


def test_bad_requests_get_a_4xx_in_openai_shape_and_never_reach_the_core(server) -> None:
    wait_for_metrics(server.url, kv_idle)
    before = metrics(server.url)["pyserve_prefix_cache_queried_tokens_total"]
    for body, param in BAD:
        status, _, raw = request(server.url + "/v1/responses", body, method="POST")
        assert 400 <= status < 500, (body, raw)
        error = json.loads(raw)["error"]
        assert error["type"] and isinstance(error["message"], str), raw
        if param is not None:
            assert error["param"] == param, (body, error)
    for method, path in [
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("GET", "/v1/responses/resp_nope/input_items"),
        ("POST", "/v1/responses/resp_nope/cancel"),
    ]:
        status, _, raw = request(server.url + path, method=method)
        assert status in (400, 404), (path, raw)
        assert json.loads(raw)["error"]["message"]
    assert metrics(server.url)["pyserve_prefix_cache_queried_tokens_total"] == before


# ----------------------------------------------------------------------------- restarts


def test_a_restarted_server_continues_a_stored_conversation(model, tmp_path) -> None:
    state = tmp_path / "restart-state"
    args = [*base_args(model, state), "--api-key", "k1"]
    with running_server(args) as server, openai_client(server) as client:
        client.api_key = "k1"
        first = client.responses.create(
            input=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
            max_output_tokens=MAX,
        )  # fmt: skip
    [call] = calls(first)
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    with running_server(args) as server, openai_client(server) as client:
        client.api_key = "k1"
        assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
        second = client.responses.create(
            previous_response_id=first.id, input=follow, max_output_tokens=3, temperature=0
        )
        replay = [{"role": "user", "content": ASK}, call.model_dump(), *follow]
        whole = client.responses.create(input=replay, max_output_tokens=3, temperature=0)
        assert second.usage.input_tokens == whole.usage.input_tokens
        assert second.output_text == whole.output_text
    # Another key sees none of it; a store of 0 MB keeps nothing.
    other = [*base_args(model, state), "--api-key", "k2", "--responses-store-mb", "0"]
    with running_server(other) as server, openai_client(server) as client:
        client.api_key = "k2"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        kept = client.responses.create(input="x", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept.id)
    with running_server([*base_args(model, state), "--api-key", "k2"]) as server:
        status, _, _ = request(
            f"{server.url}/v1/responses/{first.id}", headers={"Authorization": "Bearer k2"}
        )
        assert status == 404


# ----------------------------------------------------------------------------- reasoning

# Opens the thought unless enable_thinking is false; then, as Qwen3's does, writes it empty.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is not defined or enable_thinking %}"
    "{{ '<think>\n' }}{% else %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_server(model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinking") / "thinking-model"
    shutil.copytree(model, directory)
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    state = tmp_path_factory.mktemp("thinking-state")
    args = [*base_args(directory, state), "--reasoning-parser", "deepseek_r1"]
    with running_server(args) as server:
        yield server


def test_a_thought_is_a_reasoning_item_and_effort_none_turns_it_off(thinking_server) -> None:
    with openai_client(thinking_server) as client:
        response = client.responses.create(input="Think.", max_output_tokens=6, temperature=0)
        [item] = response.output
        assert item.type == "reasoning" and item.id.startswith("rs_")
        assert item.status == "incomplete" and item.content[0].text
        assert response.status == "incomplete"
        events = list(
            client.responses.create(input="Think.", max_output_tokens=6, temperature=0, stream=True)
        )
        check_stream(events)
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == item.content[0].text == events[-1].response.output[0].content[0].text
        # The conversation goes on from a response that ended in its thought.
        follow = client.responses.create(
            previous_response_id=response.id, input="More.", max_output_tokens=2
        )
        assert follow.usage.input_tokens > response.usage.input_tokens
        plain = client.responses.create(
            input="Think.", max_output_tokens=6, temperature=0, reasoning={"effort": "none"}
        )
        assert [i.type for i in plain.output] == ["message"]
        assert plain.reasoning.effort == "none"
