"""The HTTP layer's pure parts: request validation, parameter mapping, response shapes, the
OpenAPI document and the merging of choice streams. No engine, no server."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pyserve.http import params
from pyserve.http.bodies import decode
from pyserve.http.errors import APIError
from pyserve.http.merge import merge_choices
from pyserve.http.openai_format import chat_logprobs, completion_logprobs, usage_of
from pyserve.http.openapi import ROUTES, openapi_document
from pyserve.http.pipeline import ChoiceResult
from pyserve.http.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from pyserve.outputs import GenerationChunk, TokenLogprob

CHAT = b'{"messages": [{"role": "user", "content": "hi"}]'


def chat(extra: bytes = b"") -> bytes:
    return CHAT + extra + b"}"


def error_of(body: bytes, type_=ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        decode(body, type_)
    assert info.value.status == 400
    body = msgspec.json.decode(info.value.body())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"", None, None),
        (b"{", None, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "\xff"}]}', None, "invalid_json"),
        (b"[" * 5000 + b"]" * 5000, None, "invalid_value"),  # decodes as an array: wrong type
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "invalid_json"),
        (b'{"messages": []}', "messages", "invalid_value"),
        (chat(b', "max_tokens": 0'), "max_tokens", "invalid_value"),
        (chat(b', "max_tokens": "12"'), "max_tokens", "invalid_value"),
        (chat(b', "n": %d' % (MAX_N + 1)), "n", "invalid_value"),
        (chat(b', "temperature": -1'), "temperature", "invalid_value"),
        (chat(b', "top_p": 0'), "top_p", "invalid_value"),
        (chat(b', "stop": [""]'), "stop[0]", "invalid_value"),
        (chat(b', "seed": -5'), "seed", "invalid_value"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role", None),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', None, None),
    ],
)
def test_invalid_chat_bodies_are_400_with_the_openai_error_shape(body, param, code):
    error = error_of(body)
    if param is not None:
        assert error.info.param == param, error.message
    if code is not None:
        assert error.info.code == code, error.message


def test_valid_bodies_decode_with_openai_defaults():
    req = decode(chat(b', "stop": "x", "unknown_field": {"a": [1]}'), ChatCompletionRequest)
    assert req.stop == "x" and req.n == 1 and req.stream is False and req.max_tokens is None
    parts = b'{"role": "user", "content": [{"type": "text", "text": "a"}, '
    parts += b'{"type": "text", "text": "b"}]}'
    req = decode(b'{"messages": [' + parts + b"]}", ChatCompletionRequest)
    assert req.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    completion = decode(b'{"prompt": [[1, 2], [3]]}', CompletionRequest)
    assert completion.max_tokens == 16  # the legacy API's default
    generate = decode(b'{"input_ids": [5, 6], "sampling_params": {"top_k": -1}}', GenerateRequest)
    assert generate.sampling_params.max_new_tokens == 128


def test_the_fields_sglang_router_adds_pass_quietly_at_their_defaults_only(caplog):
    from pyserve.http import bodies

    bodies._warned.clear()
    added = b', "no_stop_trim": false, "separate_reasoning": true, "stream_reasoning": true'
    added += b', "continue_final_message": false, "return_hidden_states": false'
    with caplog.at_level("WARNING", logger=bodies.log.name):
        decode(chat(added), ChatCompletionRequest)
    assert not caplog.records
    with caplog.at_level("WARNING", logger=bodies.log.name):  # a value pyserve would not honour
        decode(chat(b', "return_hidden_states": true'), ChatCompletionRequest)
    assert ["return_hidden_states" in r.getMessage() for r in caplog.records] == [True]


def test_sampling_parameters_map_to_the_engine():
    req = decode(
        chat(b', "seed": 10, "top_k": -1, "max_tokens": 3, "max_completion_tokens": 5'),
        ChatCompletionRequest,
    )
    assert params.chat_max_tokens(req) == 5  # the current name wins over the deprecated one
    second = params.openai_sampling(req, None).params(max_new_tokens=5, choice=1)
    assert second.seed == 11 and second.top_k == 0 and second.logprobs is False
    assert second.temperature == 1.0 and second.max_new_tokens == 5
    with pytest.raises(APIError):
        params.chat_top_logprobs(decode(chat(b', "top_logprobs": 2'), ChatCompletionRequest))
    assert params.chat_top_logprobs(decode(chat(b', "logprobs": true'), ChatCompletionRequest)) == 0
    for extra in (b', "suffix": "x"', b', "best_of": 3', b', "echo": true, "logprobs": 1'):
        with pytest.raises(APIError):
            params.check_completion_request(
                decode(b'{"prompt": "a"' + extra + b"}", CompletionRequest)
            )
    detok = params.openai_sampling(
        decode(chat(b', "stop": "END"'), ChatCompletionRequest), None
    ).detok()
    assert detok.stop == ["END"] and detok.skip_special_tokens is True


def test_logprob_shapes_follow_openai():
    texts = {5: "Hel", 6: "lo", 7: " world"}
    entries = [TokenLogprob(5, -0.1, [(5, -0.1), (7, -2.5)]), TokenLogprob(6, -0.2, [(7, -0.1)])]
    content = chat_logprobs(entries, texts.__getitem__)["content"]
    assert content[0] == {
        "token": "Hel",
        "logprob": -0.1,
        "bytes": list(b"Hel"),
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
            {"token": " world", "logprob": -2.5, "bytes": list(b" world")},
        ],
    }
    legacy, offset = completion_logprobs(entries, texts.__getitem__, text_offset=4)
    assert legacy["tokens"] == ["Hel", "lo"] and legacy["token_logprobs"] == [-0.1, -0.2]
    assert legacy["text_offset"] == [4, 7] and offset == 9
    # the sampled token is always among top_logprobs, as OpenAI documents
    assert legacy["top_logprobs"][1] == {" world": -0.1, "lo": -0.2}


def test_usage_counts_each_prompt_once_and_every_choice():
    choices = []
    for prompt_tokens, completion in [(10, 3), (10, 4), (7, 5), (7, 6)]:
        result = ChoiceResult()
        result.add(
            GenerationChunk(
                rid="r",
                text="x",
                token_ids=[1],
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                cached_tokens=prompt_tokens // 2,
                finish_reason="length",
            )
        )
        choices.append(result)
    assert usage_of(choices, n=2) == {
        "prompt_tokens": 17,
        "completion_tokens": 18,
        "total_tokens": 35,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_openapi_document_is_generated_from_the_request_types():
    doc = openapi_document("1.2.3")
    assert doc["openapi"].startswith("3.")
    for method, path, body_type, _ in ROUTES:
        operation = doc["paths"][path][method]
        if body_type is not None:
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{body_type.__name__}"
    chat_schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat_schema["required"] == ["messages"]
    assert chat_schema["properties"]["n"]["maximum"] == MAX_N
    assert chat_schema["properties"]["messages"]["minItems"] == 1


def _chunk(i: int, finish: bool) -> GenerationChunk:
    return GenerationChunk(
        rid="r",
        text=str(i),
        token_ids=[i],
        prompt_tokens=1,
        completion_tokens=i + 1,
        finish_reason="length" if finish else None,
    )


def test_merged_choices_interleave_and_every_stream_is_closed_whatever_happens():
    closed: list[int] = []

    async def stream(index: int, length: int, fail_at: int | None = None):
        try:
            for i in range(length):
                await asyncio.sleep(0.001 * (index + 1))
                if i == fail_at:
                    raise ValueError("boom")
                yield _chunk(i, i == length - 1)
        finally:
            closed.append(index)

    async def scenario():
        got = [item async for item in merge_choices([stream(0, 3), stream(1, 2)])]
        assert sorted((i, c.text) for i, c in got) == [
            (0, "0"),
            (0, "1"),
            (0, "2"),
            (1, "0"),
            (1, "1"),
        ]
        assert sorted(closed) == [0, 1]

        closed.clear()
        with pytest.raises(ValueError, match="boom"):
            async for _ in merge_choices([stream(0, 50), stream(1, 50, fail_at=2)]):
                pass
        assert sorted(closed) == [0, 1]  # the healthy stream was closed (its request aborted)

        closed.clear()
        merged = merge_choices([stream(0, 50)])
        await anext(merged)
        await merged.aclose()  # the consumer went away
        assert closed == [0]

    asyncio.run(scenario())
