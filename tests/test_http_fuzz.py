"""Bad input never gets a 5xx and never hurts the server: 1,600 malformed or extreme requests
(wrong types, huge and negative numbers, empty and long strings, invalid UTF-8, deep nesting,
unknown fields, huge n, non-JSON bodies, odd content types) against a real `pyserve run`; an
error's body is OpenAI's or, on the Messages routes, Anthropic's (both carry error.message and
error.type).

The server's context is capped at 48 tokens, so that a body that happens to be valid generates
a few tokens at most; hypothesis is derandomized, so the run is the same every time."""

from __future__ import annotations

import json

import pytest
from http_testlib import kv_idle, request, running_server, tiny_model, wait_for_metrics
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/abort_request": {"rid": "x"},
    "/flush_cache": {},
    "/v1/embeddings": {"input": ["hi", "there"]},
    "/v1/rerank": {"query": "hi", "documents": ["a", "b"], "top_n": 1},
    "/rerank": {"query": "hi", "documents": [{"text": "a"}]},
    "/v1/responses": {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2},
    "/v1/messages": {
        "model": "http-tiny-model",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/messages/count_tokens": {
        "model": "http-tiny-model",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    },
}
FIELDS = [
    "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs",
    "echo", "stream", "stream_options", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "ignore_eos", "min_tokens", "model", "text", "input_ids",
    "sampling_params", "tokens", "rid", "return_logprob", "top_logprobs_num", "suffix",
    "best_of", "user", "skip_special_tokens", "unknown_field", "input", "encoding_format",
    "dimensions", "truncate_prompt_tokens", "normalize", "query", "documents", "top_n",
    "return_documents", "instruction", "instructions", "max_output_tokens", "text", "reasoning",
    "previous_response_id", "store", "include", "parallel_tool_calls", "tools", "tool_choice",
    "system", "stop_sequences",
    "thinking", "metadata",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | st.sampled_from(["", "x" * 20_000, "\ud800", "user", "assistant", "😀" * 50])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def encode(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    # GET routes: 405 for POST
    path = draw(st.sampled_from([*VALID, "/v1/models", "/v1/responses/resp_x"]))
    base = dict(VALID.get(path, {}))
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "junk", "bytes", "nested"]))
    if kind == "mutate":  # a valid body with some fields replaced by anything
        for _ in range(draw(st.integers(1, 3))):
            base[draw(st.sampled_from(FIELDS))] = draw(values)
        return path, encode(base)
    if kind == "junk":
        return path, encode(draw(values))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64) | st.just(b'{"prompt": "\xff\xfe"}'))
    depth = draw(st.integers(100, 200_000))
    return path, b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = tiny_model(tmp_path_factory.getbasetemp())
    args = ["--model", str(model), "--context-length", "48", "--kv-cache-tokens", "4096"]
    args += ["--state-dir", str(tmp_path_factory.mktemp("fuzz-state"))]
    with running_server([*args, "--torch-threads", "1"]) as server:
        yield server.url


CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded", "", "*/*"]


@settings(
    max_examples=1600,  # ~100 a route
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=bodies(), content_type=st.sampled_from(CONTENT_TYPES))
def test_malformed_requests_never_get_a_server_error(url, case, content_type):
    path, body = case
    status, _, raw = request(
        url + path, body, method="POST", headers={"Content-Type": content_type}
    )
    event(f"{path} {status}")  # pytest --hypothesis-show-statistics shows the spread
    assert status < 500, (path, body[:300], raw[:300])
    if status >= 400:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["type"]


def test_the_server_is_fine_after_the_fuzzing(url):
    assert request(url + "/health")[0] == 200
    wait_for_metrics(url, kv_idle)
