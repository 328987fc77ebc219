"""/v1/embeddings and /v1/rerank through real HTTP and the official SDK, against transformers.

One `pyserve run` server for the module, on the HTTP tests' tiny random-weight model (float32,
no quantization) with last-token pooling: every embedding then asks the prefix cache, so the
cache's query counter shows whether a refused request reached the core. Its rerank scores by the
cosine of embeddings (the model is not a reranker); the yes/no scoring of a reranker is tested
on the Engine (tests/test_engine_embeddings.py). References come from a subprocess
(tests/embedding_reference.py): this process stays torch-free.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from embedding_reference import hf_embeddings
from http_testlib import (
    kv_idle,
    metrics,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)
from openai import BadRequestError

from pyserve.model_files import load_tokenizer, resolve_model

MODEL = "http-tiny-model"
CONTEXT = 64
TOLERANCE = 1e-5
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a dragon.",
    "def fibonacci(n):",
    "Les élèves étudient le 世界",
]
QUERY = "Which animal is quick?"
DOCUMENTS = ["The quick brown fox jumps.", "Paris is a city in France.", "def f(x): return x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-dtype", "float32"]
    args += ["--quantization", "none", "--pooling", "last", "--context-length", str(CONTEXT)]
    args += ["--kv-cache-tokens", "4096", "--chunked-prefill-size", "8"]
    args += ["--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def reference(model_dir, tokenizer) -> list[np.ndarray]:
    """transformers' last-token embeddings of TEXTS, QUERY and DOCUMENTS, normalized."""
    ids = [tokenizer.encode(t) for t in [*TEXTS, QUERY, *DOCUMENTS]]
    return [unit(r["last"]) for r in hf_embeddings(model_dir, ids, [0])]


def unit(vector) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float64)
    return v / np.linalg.norm(v)


def gap(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours, dtype=np.float64) - np.asarray(theirs)).max())


def post(server, path: str, body: object) -> tuple[int, dict]:
    status, _, raw = request(server.url + path, body, method="POST")
    return status, json.loads(raw)


def test_sdk_floats_and_base64_batch_equal_single_and_transformers(client, reference, tokenizer):
    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens
    for i, text in enumerate(TEXTS):
        single = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        assert gap(single.data[0].embedding, batch.data[i].embedding) <= TOLERANCE
        assert gap(batch.data[i].embedding, reference[i]) <= TOLERANCE, f"input {i}"
    # the SDK's default asks for base64 and decodes it itself (each call is batched and cached
    # differently: the same within float32 rounding)
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for i in range(len(TEXTS)):
        assert gap(decoded.data[i].embedding, batch.data[i].embedding) <= TOLERANCE
        values = np.frombuffer(base64.b64decode(raw.data[i].embedding), dtype="<f4")
        assert gap(values, batch.data[i].embedding) <= TOLERANCE


def test_token_id_inputs_equal_their_text(client, tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert gap(by_ids.data[1].embedding, by_text.data[1].embedding) <= TOLERANCE
    assert gap(one.data[0].embedding, by_text.data[0].embedding) <= TOLERANCE
    assert one.usage.prompt_tokens == len(ids[0])


def test_too_long_inputs_are_a_400_or_truncated(server, client, tokenizer):
    long = [5] * (CONTEXT + 1)
    with pytest.raises(BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=long)
    assert info.value.code == "context_length_exceeded"
    cut = client.embeddings.create(
        model=MODEL, input=long, encoding_format="float", extra_body={"truncate_prompt_tokens": 8}
    )
    same = client.embeddings.create(model=MODEL, input=[5] * 8, encoding_format="float")
    assert cut.usage.prompt_tokens == 8
    assert gap(cut.data[0].embedding, same.data[0].embedding) <= TOLERANCE
    full = client.embeddings.create(model=MODEL, input=[5] * CONTEXT)  # fills the context
    assert full.usage.prompt_tokens == CONTEXT


BAD_EMBEDDINGS = [
    ({"input": "hi", "dimensions": 8}, "dimensions"),  # no Matryoshka dimensions declared
    ({"input": ""}, "input[0]"),
    ({"input": []}, None),
    ({"input": [[]]}, "input[0]"),
    ({"input": ["a", [1, 2]]}, "input"),
    ({"input": [1, "a"]}, "input[0]"),
    ({"input": [2**40]}, None),
    ({"input": [-1]}, None),
    ({"input": "hi", "encoding_format": "int8"}, None),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": CONTEXT + 1}, "truncate_prompt_tokens"),
    ({"input": [10**6]}, None),  # outside the vocabulary
    ({"input": "hi", "model": "another-model"}, "model"),
    ({}, None),
]
BAD_RERANKS = [
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "", "documents": ["a"]}, "query"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, None),
    ({"query": "q", "documents": [1]}, None),
    ({"documents": ["a"]}, None),
]


def test_bad_requests_get_a_4xx_in_openai_shape_and_never_reach_the_core(server, tokenizer):
    wait_for_metrics(server.url, kv_idle)
    before = metrics(server.url)["pyserve_prefix_cache_queried_tokens_total"]
    for body, param in BAD_EMBEDDINGS:
        status, answer = post(server, "/v1/embeddings", body)
        assert 400 <= status < 500, (body, answer)
        error = answer["error"]
        assert error["type"] and isinstance(error["message"], str), answer
        if param is not None:
            assert error["param"] == param, (body, error)
    for body, param in BAD_RERANKS:
        for path in ("/v1/rerank", "/rerank"):
            status, answer = post(server, path, body)
            assert 400 <= status < 500, (path, body, answer)
            if param is not None:
                assert answer["error"]["param"] == param, (body, answer)
    # A probe after them: the counter moves by the probe's own query (a prompt's last token is
    # never matched), so any refused request that reached the core would show on top of it.
    probe = [11, 12, 13, 14, 15, 16, 17]
    assert post(server, "/v1/embeddings", {"input": probe})[0] == 200
    after = wait_for_metrics(
        server.url, lambda m: m["pyserve_prefix_cache_queried_tokens_total"] > before
    )["pyserve_prefix_cache_queried_tokens_total"]
    assert after == before + len(probe) - 1


def test_rerank_orders_by_cosine_of_transformers_embeddings(server, reference):
    query, docs = reference[len(TEXTS)], reference[len(TEXTS) + 1 :]
    expected = [float(np.dot(query, d)) for d in docs]
    status, body = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    for r in results:
        assert abs(r["relevance_score"] - expected[r["index"]]) <= TOLERANCE
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert body["usage"]["prompt_tokens"] > 0
    # Cohere's document objects, top_n, no documents back, and the route without /v1
    status, top = post(
        server,
        "/rerank",
        {
            "query": QUERY,
            "documents": [{"text": d} for d in DOCUMENTS],
            "top_n": 2,
            "return_documents": False,
        },
    )
    assert status == 200, top
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top["results"])


def test_models_and_server_info_name_what_the_model_serves(server, client):
    card = client.models.list().data[0]
    assert card.model_extra["capabilities"] == ["generate", "embed", "rerank"]
    _, _, raw = request(server.url + "/server_info")
    info = json.loads(raw)
    assert info["capabilities"] == ["generate", "embed", "rerank"]
    assert info["embedding"]["pooling"] == "last" and info["embedding"]["normalize"] is True
    assert info["embedding"]["rerank"]["mode"] == "cosine"
    wait_for_metrics(server.url, kv_idle)
