"""Every route other than the OpenAI completions, and the error cases, through real HTTP against
one `pyserve run` server on the tiny model: /generate (SGLang-style) against Hugging Face's
greedy outputs, /tokenize, /detokenize, /v1/models, /health, /server_info, /metrics,
/openapi.json, /flush_cache, /abort_request."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest
from http_testlib import (
    check_against_reference,
    kv_idle,
    metrics,
    references,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)

from pyserve.http.openapi import ROUTES
from pyserve.model_files import load_tokenizer, resolve_model

MODEL = "http-tiny-model"
KV_TOKENS = 4096
CONTEXT = 2048  # --context-length caps the model's 16k positions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def refs(model_dir):
    return references(model_dir)


@pytest.fixture(scope="module")
def url(model_dir):
    # the exact mode: float32 compute and K/V (auto would store K/V in float16 on the CPU)
    args = ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-dtype", "float32"]
    args += ["--kv-cache-tokens", str(KV_TOKENS)]
    args += ["--context-length", str(CONTEXT), "--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server.url


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def post(url: str, body: object = b"") -> tuple[int, dict]:
    status, _, raw = request(url, body, method="POST")
    return status, json.loads(raw)


def get(url: str) -> tuple[int, dict]:
    status, _, raw = request(url)
    return status, json.loads(raw)


GREEDY = {"temperature": 0, "ignore_eos": True}


# ----------------------------------------------------------------------------- /generate


def test_generate_matches_transformers_for_ids_text_and_batches(url, refs):
    n = len(refs[0]["output"])
    sampling = {**GREEDY, "max_new_tokens": n}
    for ref in refs:
        body = {"input_ids": ref["prompt"], "sampling_params": sampling, "return_logprob": True}
        status, out = post(url + "/generate", body)
        assert status == 200, out
        same = check_against_reference(out["output_ids"], ref, "generate")
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ref["prompt"]) and meta["completion_tokens"] == n
        assert meta["finish_reason"] == {"type": "length", "length": n}
        assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0
        logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
        for logprob, theirs in zip(logprobs[:same], ref["logprobs"], strict=False):
            assert abs(logprob - theirs) < 2e-3
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]

        status, by_text = post(
            url + "/generate", {"text": ref["text"], "sampling_params": sampling}
        )
        assert by_text["output_ids"] == out["output_ids"] and by_text["text"] == out["text"]

    status, batch = post(
        url + "/generate", {"text": [r["text"] for r in refs[:2]], "sampling_params": sampling}
    )
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    for out, ref in zip(batch, refs[:2], strict=True):
        check_against_reference(out["output_ids"], ref, "batch")


def test_generate_streams_cumulative_text_and_stop_reasons(url, refs):
    body = {"text": refs[1]["text"], "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    _, full = post(url + "/generate", body)
    status, _, raw = request(url + "/generate", {**body, "stream": True})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    assert texts[-1] == full["text"] and events[-1]["output_ids"] == full["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in events][-1]["type"] == "length"
    eos = full["output_ids"][2]  # make the third token a stop token
    stop = {"text": refs[1]["text"], "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    stop["sampling_params"]["stop_token_ids"] = [eos]
    _, stopped = post(url + "/generate", stop)
    assert stopped["output_ids"] == full["output_ids"][:3]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


# ----------------------------------------------------------------------------- service routes


def test_models_health_tokenize_detokenize(url, tokenizer):
    status, models = get(url + "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, CONTEXT)]
    assert get(url + f"/v1/models/{MODEL}")[0] == 200
    assert get(url + "/v1/models/other")[0] == 404
    assert get(url + "/health") == (200, {"status": "ok"})

    text = "Hello world, les élèves 世界 🙂"
    status, tokens = post(url + "/tokenize", {"prompt": text})
    assert status == 200 and tokens["tokens"] == tokenizer.encode(text)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == CONTEXT
    assert post(url + "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": text})


def test_server_info_metrics_and_openapi(url):
    status, info = get(url + "/server_info")
    assert status == 200 and info["status"] == "ok" and info["model"] == MODEL
    assert info["kv_cache"]["tokens"] == KV_TOKENS and info["context_length"] == CONTEXT
    assert info["versions"]["pyserve"] and info["http"]["api_key_required"] is False

    post(url + "/generate", {"text": "Metrics please", "sampling_params": {"max_new_tokens": 4}})
    status, headers, raw = request(url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    values = metrics(url)
    assert values["pyserve_kv_blocks_total"] == KV_TOKENS // 16
    assert values["pyserve_generation_tokens_total"] >= 4
    assert values["pyserve_time_to_first_token_seconds_count"] >= 1
    assert values["pyserve_e2e_request_latency_seconds_count"] >= 1
    for name in ("pyserve_inter_token_latency_seconds", "pyserve_prompt_tokens_total"):
        assert name.encode() in raw

    status, doc = get(url + "/openapi.json")
    assert status == 200
    for method, path, _, _ in ROUTES:
        assert method in doc["paths"][path]
    assert "GenerateRequest" in doc["components"]["schemas"]


def test_flush_cache_releases_the_cached_blocks(url):
    prompt = "A long prompt that fills a few blocks of the prefix cache. " * 8
    post(url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 2}})
    cached = wait_for_metrics(url, lambda m: m["pyserve_kv_blocks_cached"] > 0)
    status, out = post(url + "/flush_cache")
    assert status == 200 and out["released_blocks"] >= cached["pyserve_kv_blocks_cached"]
    after = wait_for_metrics(url, lambda m: m["pyserve_kv_blocks_cached"] == 0)
    assert kv_idle(after)


def test_abort_request_ends_a_running_stream_with_finish_reason_abort(url):
    body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 1500, "stream": True, **GREEDY}

    async def scenario():
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/completions", json=body) as resp,
        ):
            first = json.loads((await resp.content.readuntil(b"\n\n"))[6:])
            aborted = await session.post(url + "/abort_request", json={"rid": first["id"]})
            assert await aborted.json() == {"rid": first["id"], "aborted": True}
            rest = await resp.read()
        return rest

    rest = asyncio.run(scenario())
    events = [json.loads(e[6:]) for e in rest.split(b"\n\n")[:-2]]
    assert rest.endswith(b"data: [DONE]\n\n")
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert post(url + "/abort_request", {"rid": "nothing-like-it"}) == (
        200,
        {"rid": "nothing-like-it", "aborted": False},
    )
    wait_for_metrics(url, kv_idle)


# ----------------------------------------------------------------------------- errors

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONG = "word " * 3000  # ~3000 tokens: more than the 2048 context


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        (CHAT, b"{not json", 400, "invalid_json", None),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
            400,
            "invalid_json",
            None,
        ),
        (CHAT, b"[" * 50_000 + b"]" * 50_000, 400, None, None),
        (CHAT, {"messages": "hi"}, 400, "invalid_value", "messages"),
        (CHAT, {"messages": []}, 400, "invalid_value", "messages"),
        (CHAT, {"messages": HI, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
        (CHAT, {"messages": HI, "n": 10**9}, 400, "invalid_value", "n"),
        (CHAT, {"messages": HI, "temperature": "hot"}, 400, "invalid_value", "temperature"),
        (CHAT, {"messages": HI, "model": "gpt-9"}, 404, "model_not_found", "model"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": LONG}]},
            400,
            "context_length_exceeded",
            None,
        ),
        ("/v1/completions", {"prompt": [1, "a"]}, 400, None, "prompt"),
        ("/v1/completions", {"prompt": [10**6]}, 400, "invalid_value", None),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, None, "suffix"),
        ("/generate", {"text": "a", "input_ids": [1]}, 400, None, "text"),
        ("/generate", {}, 400, None, "text"),
        ("/detokenize", {"tokens": [49152]}, 400, "invalid_value", None),
        ("/tokenize", {"prompt": 5}, 400, "invalid_value", "prompt"),
        ("/abort_request", {}, 400, "invalid_value", None),
        ("/no/such/route", {}, 404, "not_found", None),
    ],
)
def test_bad_requests_get_openai_error_bodies(url, path, body, status, code, param):
    got, _, raw = request(url + path, body, headers={"Content-Type": "application/json"})
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


def test_context_length_error_names_both_numbers(url, tokenizer):
    prompt_tokens = len(tokenizer.encode("hello " * 100))
    status, body = post(url + "/v1/completions", {"prompt": "hello " * 100, "max_tokens": 2000})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    message = body["error"]["message"]
    assert str(CONTEXT) in message and str(prompt_tokens) in message


def test_wrong_method_is_405_and_content_type_is_not_required(url):
    status, headers, raw = request(url + CHAT, method="GET")
    assert status == 405 and "POST" in headers["Allow"]
    assert json.loads(raw)["error"]["code"] == "method_not_allowed"
    # curl -d sends application/x-www-form-urlencoded; a JSON body is accepted all the same
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert request(url + CHAT, body, headers=form)[0] == 200
    wait_for_metrics(url, kv_idle)
