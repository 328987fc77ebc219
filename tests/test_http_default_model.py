"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) served by a plain `pyserve run`
knows the capital of France."""

from __future__ import annotations

from http_testlib import running_server
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
    text = answer.choices[0].message.content
    assert "Paris" in text, text
