"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) served by a plain `pyserve run`
knows the capital of France; with the default `--quantization auto` it serves the file's 4-bit
weights on the int4 kernels, and says so in /server_info and its startup log. Its chat template
has no tool-call format: tools go through the generic one."""

from __future__ import annotations

import json

import pytest
from http_testlib import request, running_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    with running_server(["--torch-threads", "2", "--kv-cache-tokens", "4096"]) as server:
        yield server


def test_default_model_answers_paris(server, client):
    [model] = client.models.list().data
    assert model.id == MODEL
    answer = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    # a prompt longer than the 512-token CPU prefill budget: its first chunk samples no
    # token, which once failed every such request (the int4 output projection got no rows)
    long = client.completions.create(
        model=model.id, prompt="The sea is blue. " * 150, max_tokens=4, temperature=0
    )
    status, _, body = request(server.url + "/server_info")
    log = server.log()
    assert long.usage.prompt_tokens > 512 and long.usage.completion_tokens == 4
    text = answer.choices[0].message.content
    assert "Paris" in text, text
    info = json.loads(body)
    assert status == 200 and info["config"]["quantization"] == "auto"
    # K and V in float16, as llama.cpp keeps them (pyserve/worker/dtypes.py)
    assert info["quantization"] == "int4" and info["dtype"] == "float32"
    assert info["kv_cache"]["dtype"] == "float16"
    assert "quantization int4" in log
    assert info["prefill_budget"] == {"max_prefill_tokens": 512, "chunked_prefill_size": 512}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_default_model_calls_a_tool_when_required(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=128,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
