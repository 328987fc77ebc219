"""Every route other than the OpenAI completions, and the error cases, through real HTTP against
one `pyserve run` server on the tiny model: /generate (SGLang-style) against Hugging Face's
greedy outputs, /tokenize, /detokenize, /v1/models, /health, /server_info, /metrics,
/openapi.json, /flush_cache, /abort_request."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
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

from pyserve.engine.errors import EngineDeadError
from pyserve.http import service_routes
from pyserve.http.app import create_app
from pyserve.http.openapi import ROUTES
from pyserve.model_files import load_tokenizer, resolve_model
from pyserve.outputs import GenerationChunk

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


# ----------------------------------------------------------------------------- worker routes
# What sglang-router and SGLang's clients ask of a worker (tests/test_router_replicas.py runs
# the router itself).


def test_the_model_path_is_another_name_of_the_model(url, model_dir):
    path = str(Path(model_dir).resolve())
    _, info = get(url + "/server_info")
    assert info["model_path"] == path
    status, out = post(
        url + "/v1/chat/completions",
        {"model": path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    assert status == 200 and out["model"] == MODEL, out
    status, out = post(url + "/v1/completions", {"model": path, "prompt": "Hi", "max_tokens": 1})
    assert status == 200 and out["model"] == MODEL, out
    assert post(url + "/tokenize", {"model": path, "prompt": "Hi"})[0] == 200
    _, models = get(url + "/v1/models")
    assert [(m["id"], m["root"]) for m in models["data"]] == [(MODEL, path)]
    status, out = post(url + "/v1/completions", {"model": path + "x", "prompt": "Hi"})
    assert (status, out["error"]["code"]) == (404, "model_not_found")


def test_server_info_and_model_info_carry_sglangs_fields(url, model_dir):
    path = str(Path(model_dir).resolve())
    status, info = get(url + "/server_info")
    assert status == 200
    assert info["served_model_name"] == MODEL and info["tokenizer_path"] == path
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["max_total_tokens"] == KV_TOKENS == info["kv_cache"]["tokens"]
    assert info["max_running_requests"] == info["config"]["max_running_requests"]
    budget = info["prefill_budget"]
    assert info["max_prefill_tokens"] == budget["max_prefill_tokens"]
    assert info["chunked_prefill_size"] == budget["chunked_prefill_size"]
    assert info["version"] == info["versions"]["pyserve"]
    status, old = get(url + "/get_server_info")  # SGLang's older name
    assert status == 200 and old["model_path"] == path and old.keys() == info.keys()

    status, model = get(url + "/model_info")
    assert status == 200 and get(url + "/get_model_info") == (200, model)
    assert model == {
        "model_path": path,
        "served_model_name": MODEL,
        "tokenizer_path": path,  # a Hugging Face directory holds its tokenizer
        "is_generation": True,
        "model_type": "llama",
        "context_length": CONTEXT,
    }


def test_get_load_counts_requests_and_the_kv_tokens_they_hold(url):
    wait_for_metrics(url, kv_idle)
    idle = [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert get(url + "/get_load") == (200, idle)
    body = {"model": MODEL, "prompt": "Go on: " * 20, "max_tokens": 1500, "stream": True}

    async def scenario():
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/completions", json={**body, **GREEDY}) as resp,
        ):
            first = json.loads((await resp.content.readuntil(b"\n\n"))[6:])
            async with session.get(url + "/get_load") as load:
                busy = await load.json()
            await session.post(url + "/abort_request", json={"rid": first["id"]})
            await resp.read()
        return busy

    (busy,) = asyncio.run(scenario())
    assert (busy["num_reqs"], busy["num_waiting_reqs"]) == (1, 0), busy
    assert busy["num_tokens"] >= 16 and busy["num_tokens"] % 16 == 0, busy  # whole blocks
    wait_for_metrics(url, kv_idle)


def test_health_generate_answers_once_a_token_is_generated(url):
    before = metrics(url)["pyserve_streamed_tokens_total"]
    assert get(url + "/health_generate") == (200, {"status": "ok"})
    # its token counts among those handed out; the probe leaves nothing behind
    wait_for_metrics(url, lambda m: m["pyserve_streamed_tokens_total"] > before and kv_idle(m))


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
        (
            "/generate",
            {"text": "<image> a", "image_data": "data:image/png;base64,aGk="},
            400,
            "unsupported_parameter",
            "image_data",
        ),
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


# ----------------------------------------------------------------------------- /health_generate
# In process, over an engine that generates a token, fails, or never answers.


class ProbedEngine:
    """Just enough engine for /health_generate."""

    model_name = MODEL
    healthy = serving = True
    failure = health_problem = None

    def __init__(self, outcome: str, progress: bool = False) -> None:
        self.outcome = outcome  # "token", "fail" or "hang"
        self.progress = progress  # other requests get tokens meanwhile
        self.ready = True
        self.handed = 0
        self.aborted = False

    def stats(self) -> dict:
        handed = self.handed
        self.handed += self.progress
        return {"handed_tokens": handed, "num_blocks": 0, "block_size": 16}

    async def generate(self, prompt, sampling, detok=None, rid=None):
        assert sampling.max_new_tokens == 1
        try:
            if self.outcome == "fail":
                raise EngineDeadError("the worker process exited")
            if self.outcome == "hang":
                await asyncio.Event().wait()
            yield GenerationChunk("probe", "", [7], len(prompt), 1, finish_reason="length")
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted = True
            raise


async def probe(engine: ProbedEngine, **options) -> tuple[int, dict]:
    async with TestClient(TestServer(create_app(engine, web_ui=False, **options))) as client:
        response = await client.get("/health_generate")
        return response.status, await response.json()


def test_health_generate_is_200_once_a_token_comes_and_needs_no_key():
    assert asyncio.run(probe(ProbedEngine("token"), api_key="k")) == (200, {"status": "ok"})


def test_health_generate_is_503_when_the_generation_fails_or_times_out(monkeypatch):
    status, body = asyncio.run(probe(ProbedEngine("fail")))
    assert status == 503 and "the worker process exited" in body["reason"], body
    monkeypatch.setattr(service_routes, "HEALTH_GENERATE_TIMEOUT_S", 0.2)
    stuck = ProbedEngine("hang")
    status, body = asyncio.run(probe(stuck))
    assert (status, body) == (
        503,
        {"status": "unhealthy", "reason": "no token generated within 0.2 s"},
    )
    assert stuck.aborted  # the probe request does not stay behind


def test_health_generate_counts_tokens_of_other_requests_as_progress(monkeypatch):
    monkeypatch.setattr(service_routes, "HEALTH_GENERATE_TIMEOUT_S", 600.0)  # never reached
    busy = ProbedEngine("hang", progress=True)  # the probe waits behind a full batch
    assert asyncio.run(probe(busy)) == (200, {"status": "ok"})


def test_health_generate_is_503_while_loading():
    loading = ProbedEngine("token")
    loading.ready = False
    assert asyncio.run(probe(loading)) == (503, {"status": "loading"})
