"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
anthropic SDK and raw HTTP.

One `pyserve run` server for most of the module, on the tiny random-weight model with
SmolLM2's own template (so tools use the generic format), an API key, and a tiny ping interval
(PYSERVE_PING_INTERVAL) so that a long prompt's prefill may be pinged; a second one with a
template that opens a thought unless enable_thinking is false, under --reasoning-parser
deepseek_r1. A random model writes nonsense: what must parse is forced by the grammar (tool
choice `any` or a named tool), and the schemas are bounded so that every call ends.
"""

from __future__ import annotations

import json
import shutil
from typing import Literal

import anthropic
import pytest
import requests
from http_testlib import (
    kv_idle,
    metrics,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)
from messages_testlib import assemble, check_order, parse_sse
from pydantic import BaseModel

KEY = "sk-test-messages"
MAX_TOKENS = 512  # more than the longest call the bounded schemas allow
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
INPUT_KEYS = {"get_weather": {"city", "unit"}, "get_time": {"zone"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# Opens a thought unless enable_thinking is false, which closes an empty one (as Qwen3 does).
THINKING_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--model", str(model_dir), "--torch-threads", "1", "--tokenizer-workers", "1"]
    env = {"PYSERVE_PING_INTERVAL": "0.002"}
    with running_server([*args, "--api-key", KEY], env=env) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(server) -> str:
    _, _, body = request(server.url + "/v1/models", headers={"x-api-key": KEY})
    return json.loads(body)["data"][0]["id"]


def post(server, path: str, body, headers: dict | None = None) -> tuple[int, dict | bytes]:
    """(status, the JSON answer) of a POST with the key; bytes when the answer is not JSON."""
    status, _, raw = request(
        server.url + path,
        body,
        method="POST",
        headers={"x-api-key": KEY, "Content-Type": "application/json", **(headers or {})},
    )
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def raw_events(server, body: dict) -> list[dict]:
    """The data of every event of a streamed request, checked for Anthropic's order."""
    body = {k: v for k, v in body.items() if k != "extra_body"} | body.get("extra_body", {})
    response = requests.post(
        server.url + "/v1/messages",
        json={**body, "stream": True},
        headers={"x-api-key": KEY},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = [data for _, data in parse_sse(response.content)]
    check_order(events)
    return events


def blocks_of(message) -> list[dict]:
    """A message's content blocks as plain dicts without tool ids (new ones each time)."""
    blocks = []
    for block in message.content:
        data = block.model_dump(exclude_none=True)
        if block.type == "tool_use":
            assert block.id.startswith("toolu_")
            data.pop("id")
        blocks.append(data)
    return blocks


def check_tool_uses(message) -> list[tuple[str, dict]]:
    assert message.stop_reason == "tool_use", message
    calls = []
    for block in message.content:
        assert block.type == "tool_use", message  # the grammar allows calls only
        assert block.id.startswith("toolu_") and isinstance(block.input, dict)
        assert set(block.input) == INPUT_KEYS[block.name]
        calls.append((block.name, block.input))
    assert calls
    return calls


# The SDK no longer takes the sampling fields as arguments; the API still does.
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0}


def sampling(seed: int | None) -> dict:
    """Greedy, or (no seed in this API) sampling at temperature 1."""
    return GREEDY if seed is None else SAMPLED


# ----------------------------------------------------------------------------- text


def test_create_returns_a_message_whose_usage_counts_the_prompt(client, model_id) -> None:
    system = [{"type": "text", "text": "You are terse."}]
    message = client.messages.create(
        model=model_id, max_tokens=8, messages=ASK, system=system, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == model_id
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in message.content] in ([], ["text"])
    usage = message.usage
    assert 1 <= usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=model_id, messages=ASK, system=system)
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    # The same prompt again is read from the prefix cache.
    again = client.messages.create(
        model=model_id, max_tokens=8, messages=ASK, system=system, extra_body=GREEDY
    )
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    assert blocks_of(again) == blocks_of(message)


def test_a_stream_assembles_to_the_whole_message(client, server, model_id) -> None:
    body = dict(model=model_id, max_tokens=24, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert blocks_of(final) == blocks_of(whole)
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 24
    events = raw_events(server, body)
    assert assemble(events)["content"] == [b.model_dump(exclude_none=True) for b in whole.content]


def test_a_stop_sequence_ends_the_answer_and_is_named(client, server, model_id) -> None:
    body = dict(model=model_id, max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = client.messages.create(**body).content[0].text
    words = [w for w in text.split(" ")[2:] if w.strip()]
    stop = words[0][:3]
    before = text[: text.index(stop)]
    message = client.messages.create(**body, stop_sequences=[stop, "never-written-ever"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert "".join(b.text for b in message.content) == before
    events = raw_events(server, {**body, "stop_sequences": [stop]})
    final = assemble(events)
    assert (final["stop_reason"], final["stop_sequence"]) == ("stop_sequence", stop)


def test_a_long_prompt_streams_in_order_with_well_formed_pings(server, model_id) -> None:
    # The prefill of this prompt takes several steps; the ping interval is tiny, so pings
    # likely come, but whether they do depends on the machine: only their form is checked.
    long = " ".join(f"word{i}" for i in range(3000))
    body = {"model": model_id, "max_tokens": 4, "messages": [{"role": "user", "content": long}]}
    events = raw_events(server, body)
    pings = [e for e in events if e["type"] == "ping"]
    assert all(p == {"type": "ping"} for p in pings)
    assert events[-2]["type"] == "message_delta" and events[-1]["type"] == "message_stop"


# ----------------------------------------------------------------------------- tools


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_any_always_uses_a_tool(client, model_id, seed) -> None:
    message = client.messages.create(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any"},
        extra_body=sampling(seed),
    )
    check_tool_uses(message)


def test_a_named_tool_is_used_exactly_once(client, model_id) -> None:
    message = client.messages.create(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_time"},
        extra_body=GREEDY,
    )
    assert [name for name, _ in check_tool_uses(message)] == ["get_time"]


class Flags(BaseModel):
    ok: bool
    level: Literal[1, 2, 3]


# bounded (no other keys), so that a random model's answer ends
FLAGS_SCHEMA = {**Flags.model_json_schema(), "additionalProperties": False}


def test_structured_outputs_hold_the_answer_to_the_schema(client, model_id) -> None:
    parsed = client.messages.parse(
        model=model_id, max_tokens=MAX_TOKENS, messages=ASK, output_format=Flags, extra_body=GREEDY
    )  # the SDK sends output_config.format
    assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Flags)
    beta = client.messages.create(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        extra_body={
            **SAMPLED,
            "output_format": {"type": "json_schema", "schema": FLAGS_SCHEMA},
        },
    )
    Flags.model_validate_json(beta.content[0].text)
    # beside tools: a tool use, or the answer in its format
    either = client.messages.create(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=TOOLS,
        output_config={"format": {"type": "json_schema", "schema": FLAGS_SCHEMA}},
        extra_body=SAMPLED,
    )
    if either.stop_reason == "tool_use":
        check_tool_uses(either)
    else:
        Flags.model_validate_json(either.content[0].text)


def test_disable_parallel_tool_use_means_one_tool_use(client, model_id) -> None:
    for _ in range(3):
        message = client.messages.create(
            model=model_id,
            max_tokens=MAX_TOKENS,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body=SAMPLED,
        )
        assert len(check_tool_uses(message)) == 1


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_streamed_tool_uses_assemble_to_the_whole_message(client, server, model_id, choice):
    body = dict(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        extra_body=GREEDY,
    )
    whole = client.messages.create(**body)
    check_tool_uses(whole)
    with client.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's own event for each input_json_delta
    check_tool_uses(final)
    assert blocks_of(final) == blocks_of(whole)
    events = raw_events(server, body)
    assert any(e.get("delta", {}).get("type") == "input_json_delta" for e in events)
    assert [(b["name"], b["input"]) for b in assemble(events)["content"]] == [
        (b.name, b.input) for b in whole.content
    ]


def test_tool_results_go_back_to_the_model(client, model_id) -> None:
    first = client.messages.create(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    check_tool_uses(first)
    results = [
        {"type": "tool_result", "tool_use_id": block.id, "content": "18 degrees, clear skies"}
        for block in first.content
    ]
    conversation = [*ASK, {"role": "assistant", "content": first.content}]
    answer = client.messages.create(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=[*conversation, {"role": "user", "content": results}],
        tools=TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    check_tool_uses(answer)

    # The results are rendered: what they say changes the prompt, blocks read as a string,
    # and a failed call is marked as one.
    def count(content, is_error: bool = False) -> int:
        result = {"type": "tool_result", "tool_use_id": first.content[0].id, "content": content}
        if is_error:
            result["is_error"] = True
        user = {"role": "user", "content": [result, {"type": "text", "text": "And now?"}]}
        messages = [*conversation[:1], {"role": "assistant", "content": first.content[:1]}, user]
        return client.messages.count_tokens(
            model=model_id, messages=messages, tools=TOOLS
        ).input_tokens

    short = count("18")
    assert count("18 degrees, clear skies, a light wind from the west") > short
    assert count([{"type": "text", "text": "18"}]) == short
    assert count("18", is_error=True) > short


def test_tools_and_their_instructions_are_counted(client, model_id) -> None:
    plain = client.messages.count_tokens(model=model_id, messages=ASK).input_tokens
    choice = {"type": "tool", "name": "get_time"}
    with_tools = client.messages.count_tokens(
        model=model_id, messages=ASK, tools=TOOLS, tool_choice=choice
    )
    assert with_tools.input_tokens > plain + 50
    message = client.messages.create(
        model=model_id,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        extra_body=GREEDY,
    )
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == with_tools.input_tokens


# ----------------------------------------------------------------------------- errors


def anthropic_error(body: object) -> dict:
    assert isinstance(body, dict) and body["type"] == "error", body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    return error


def test_the_sdks_error_classes(server, client, model_id) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=model_id,
            max_tokens=4,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}],
        )
    error = anthropic_error(caught.value.body)
    assert error["type"] == "invalid_request_error" and "image" in error["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-not-served", max_tokens=4, messages=ASK)
    assert anthropic_error(caught.value.body)["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-not-served", messages=ASK)
    for wrong in (
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0),
        anthropic.Anthropic(base_url=server.url, auth_token="wrong", max_retries=0),
    ):
        with wrong, pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model=model_id, max_tokens=4, messages=ASK)
        assert anthropic_error(caught.value.body)["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=model_id,
            max_tokens=4,
            messages=ASK,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    assert "thinking" in anthropic_error(caught.value.body)["message"]


def test_an_image_on_a_text_only_model_is_refused_naming_its_block(server) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    in_result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}
    for blocks, where in (
        ([{"type": "text", "text": "look"}, image], "messages[0].content[1]"),
        ([in_result], "messages[0].content[0].content[0]"),
    ):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = _body(messages=_user(*blocks))
            if path.endswith("count_tokens"):
                del body["max_tokens"]
            got, answer = post(server, path, body)
            assert got == 400, answer
            error = anthropic_error(answer)
            assert error["type"] == "invalid_request_error"
            assert error["message"].startswith(f"{where}: this model takes no images"), error


def test_the_key_is_taken_from_either_header_on_every_route(server, model_id) -> None:
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    with bearer:
        assert bearer.messages.create(model=model_id, max_tokens=2, messages=ASK).content
    chat = {"model": model_id, "max_tokens": 2, "messages": ASK}
    assert post(server, "/v1/chat/completions", chat)[0] == 200  # x-api-key
    bearer_only = {"x-api-key": "", "Authorization": f"Bearer {KEY}"}
    assert post(server, "/v1/chat/completions", chat, bearer_only)[0] == 200
    status, body = post(server, "/v1/chat/completions", chat, {"x-api-key": "wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # OpenAI's shape there
    status, body = post(server, "/v1/messages", chat, {"x-api-key": "wrong"})
    assert status == 401 and anthropic_error(body)["type"] == "authentication_error"


def _body(**fields) -> dict:
    return {"model": "http-tiny-model", "max_tokens": 4, "messages": ASK, **fields}


def _user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


BAD_SCHEMA = {"name": "bad", "input_schema": {"type": "object", "properties": {"a": {"type": 7}}}}
BAD_BODIES = [
    (b"{not json", 400, "invalid_request_error"),
    (b"", 400, "invalid_request_error"),
    ({"model": "http-tiny-model", "messages": ASK}, 400, "max_tokens"),
    (_body(max_tokens=0), 400, "max_tokens"),
    (_body(messages=[]), 400, "messages"),
    (_body(messages=[{"role": "system", "content": "hi"}]), 400, "role"),
    (_body(messages=_user({"type": "video", "url": "x"})), 400, "video"),
    (_body(messages=_user({"type": "image", "source": {}})), 400, "image"),
    (_body(messages=_user({"type": "document", "source": {"type": "text"}})), 400, "document"),
    (
        _body(
            messages=_user(
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "image", "source": {}}],
                }
            )
        ),
        400,
        "image",
    ),
    (_body(messages=_user({"type": "text"})), 400, "text"),
    (_body(messages=[*ASK, {"role": "assistant", "content": "Sure"}]), 400, "prefill"),
    (_body(messages=_user({"type": "tool_use", "id": "x", "name": "f", "input": {}})), 400, ""),
    (_body(tools=[BAD_SCHEMA], tool_choice={"type": "any"}), 400, ""),
    (_body(tools=[BAD_SCHEMA]), 400, ""),
    (_body(tools=[{"name": "f", "input_schema": {"type": "string"}}]), 400, "object"),
    (_body(tools=[{"name": "f"}]), 400, "input_schema"),
    (_body(tools=[{"name": "bash", "type": "bash_20250124"}]), 400, "bash_20250124"),
    (_body(tools=[WEATHER, WEATHER]), 400, "twice"),
    (_body(tools=[{"name": "bad name!", "input_schema": {"type": "object"}}]), 400, "name"),
    (_body(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), 400, "nope"),
    (_body(tool_choice={"type": "any"}), 400, "tool_choice"),
    (_body(tool_choice={"type": "sometimes"}), 400, "sometimes"),
    (_body(thinking={"type": "enabled", "budget_tokens": 10}), 400, "budget_tokens"),
    (_body(thinking={"type": "enabled", "budget_tokens": 2048}), 400, "thinking"),
    (_body(thinking={"type": "between_tools"}), 400, "between_tools"),
    (_body(thinking={"type": "adaptive", "display": "omitted"}), 400, "display"),
    (_body(stop_sequences=[""]), 400, "stop_sequences"),
    (_body(temperature=-1), 400, "temperature"),
    (_body(top_k=-5), 400, "top_k"),
    (_body(output_format={"type": "json_schema", "schema": {"type": 7}}), 400, "output_format"),
    (_body(output_config={"format": {"type": "json_schema", "schema": {"type": "foo"}}}), 400, ""),
    (
        _body(
            output_format={"type": "json_schema", "schema": {"type": "object"}},
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        ),
        400,
        "output_format",
    ),
    (_body(output_config={"effort": "high"}), 400, "effort"),  # the template reads none
    (_body(mcp_servers=[{"url": "x"}]), 400, "mcp_servers"),
    (_body(service_tier="priority"), 400, "service_tier"),
    (_body(system=[{"type": "image", "source": {}}]), 400, "image"),
    (_body(max_tokens=10**6), 400, "context"),
    (_body(max_tokens=10**6, stream=True), 400, "context"),  # before the stream opens
    (_body(model="claude-opus-4"), 404, "claude-opus-4"),
]


# Fields of /v1/messages that /v1/messages/count_tokens does not take (nor refuse)
GENERATION_ONLY = {
    "max_tokens",
    "context",
    "temperature",
    "top_k",
    "stop_sequences",
    "service_tier",
}


def test_bad_requests_get_a_4xx_in_anthropics_shape_and_never_reach_the_core(server):
    wait_for_metrics(server.url, kv_idle, headers={"x-api-key": KEY})
    before = metrics(server.url, {"x-api-key": KEY})["pyserve_prefix_cache_queried_tokens_total"]
    for body, status, words in BAD_BODIES:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            if path.endswith("count_tokens") and isinstance(body, dict):
                if words in GENERATION_ONLY:
                    continue  # fields a token count does not take
                body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
            got, answer = post(server, path, body)
            assert got == status, (path, body, answer)
            error = anthropic_error(answer)
            expected = "not_found_error" if status == 404 else "invalid_request_error"
            assert error["type"] == expected, (path, body, answer)
            assert words.lower() in error["message"].lower() or words == expected, (body, error)
    for path in ("/v1/messages/batches", "/v1/messages/nope/more"):
        got, answer = post(server, path, _body())
        assert got == 404 and anthropic_error(answer)["type"] == "not_found_error"
    status, _, raw = request(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert status == 405 and anthropic_error(json.loads(raw))["type"] == "invalid_request_error"
    # A probe after them: the counter moves by the probe's own query (a prompt's last token is
    # never matched), so any refused request that reached the core would show on top of it.
    probe = [11, 12, 13, 14, 15, 16, 17]
    generate = {"input_ids": probe, "sampling_params": {"max_new_tokens": 1}}
    assert post(server, "/generate", generate)[0] == 200
    after = wait_for_metrics(
        server.url,
        lambda m: m["pyserve_prefix_cache_queried_tokens_total"] > before,
        headers={"x-api-key": KEY},
    )["pyserve_prefix_cache_queried_tokens_total"]
    assert after == before + len(probe) - 1


def test_fields_that_change_nothing_are_accepted(client, model_id) -> None:
    message = client.messages.create(
        model=model_id,
        max_tokens=2,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        metadata={"user_id": "someone"},
        service_tier="auto",
        extra_body={"top_p": 0.9, "top_k": 40, "temperature": 0.5},
        cache_control={"type": "ephemeral"},
        thinking={"type": "adaptive"},
        tool_choice={"type": "none"},
        tools=TOOLS,
    )
    assert message.usage.output_tokens <= 2
    assert all(b.type == "text" for b in message.content)


# ----------------------------------------------------------------------------- thinking


@pytest.fixture(scope="module")
def thinking_server(model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinking") / "thinking-model"
    shutil.copytree(model_dir, directory)
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    args = ["--model", str(directory), "--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server([*args, "--reasoning-parser", "deepseek_r1"]) as server:
        yield server


def test_thinking_enabled_and_disabled(thinking_server) -> None:
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0)
    with client:
        _, _, raw = request(thinking_server.url + "/v1/models")
        model = json.loads(raw)["data"][0]["id"]
        body = dict(model=model, max_tokens=16, messages=ASK, extra_body=GREEDY)
        enabled = {"type": "enabled", "budget_tokens": 1024}
        # A random model never ends its thought: all of its output is the thinking block.
        for thinking in (enabled, None):
            extra = {} if thinking is None else {"thinking": thinking}
            message = client.messages.create(**body, **extra)
            assert [b.type for b in message.content] == ["thinking"], message
            assert message.content[0].thinking and message.stop_reason == "max_tokens"
            with client.messages.stream(**body, **extra) as stream:
                kinds = [event.type for event in stream]
                final = stream.get_final_message()
            assert "thinking" in kinds  # the SDK's event for each thinking_delta
            assert blocks_of(final) == blocks_of(message)
            events = raw_events(thinking_server, {**body, **extra})
            assert assemble(events)["content"] == blocks_of(message)
        # Disabled, the template closes the thought in the prompt: the answer is all text.
        message = client.messages.create(**body, thinking={"type": "disabled"})
        assert [b.type for b in message.content] == ["text"], message
        # An earlier turn's thinking block is accepted (and given to the template).
        turn = [
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Paris?", "signature": ""},
                    {"type": "text", "text": "Sunny."},
                ],
            },
            {"role": "user", "content": "Thanks."},
        ]
        assert client.messages.create(**{**body, "messages": turn}).content
