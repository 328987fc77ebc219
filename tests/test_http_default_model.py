"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) served by a plain `pyserve run`
knows the capital of France; with the default `--quantization auto` it serves the file's 4-bit
weights on the int4 kernels, and says so in /server_info and its startup log."""

from __future__ import annotations

import json

from http_testlib import request, running_server
from openai import OpenAI


def test_default_model_answers_paris():
    with (
        running_server(["--torch-threads", "2", "--kv-cache-tokens", "4096"]) as server,
        OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        [model] = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct"
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
