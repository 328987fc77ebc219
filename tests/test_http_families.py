"""Qwen3, Gemma 3, Qwen3-MoE and gpt-oss through a real `pyserve run`: tiny random-weight models
with SmolLM2's vocabulary and tokenizer (so text prompts and chat templates work) and the family's
features on (q/k norms; Gemma's sliding windows shorter than the prompts, (1 + w) norms,
sandwich norms, GELU-tanh, two rope tables; a mixture of 8 experts, top-2; gpt-oss's sinks,
biases, windows and clamped SwiGLU, here with SmolLM2's chat template). Prompts are
prefilled in small chunks; a prompt whose prefix the cache holds gives the same tokens as the
same prompt cold, and both equal Hugging Face's greedy output on the same weights (K/V in
float32, so that the only differences are HF's own near-ties). Qwen3 is also served with
``--backend triton``: the GPU backend end to end, its kernels in Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1, which the server's worker inherits).
"""

from __future__ import annotations

import json

import pytest
from http_testlib import (
    REFERENCE_NEW_TOKENS,
    REFERENCE_PROMPTS,
    check_against_reference,
    generate,
    references,
    request,
    running_server,
)
from tiny_models import build_tiny_smollm

WINDOW = 6  # tokens: shorter than the prompts below and than their continuations
FAMILIES = {
    "qwen3": {"head_dim": 16},
    "gemma3": {
        "head_dim": 16,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    },
    "qwen3moe": {
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "gpt-oss": {
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
LONG_PROMPTS = [p + " and then, after a long while, it went on" for p in REFERENCE_PROMPTS]
# server: (family, backend); the default backend is the CPU kernels where they apply
SERVERS = {
    "qwen3": ("qwen3", None),
    "gemma3": ("gemma3", None),
    "qwen3moe": ("qwen3moe", None),
    "gpt-oss": ("gpt-oss", None),
    "qwen3-triton": ("qwen3", "triton"),
}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tmp_path_factory):
    family, backend = SERVERS[request.param]
    directory = tmp_path_factory.mktemp(f"http-{request.param}")
    build_tiny_smollm(
        directory,
        seed=77,
        max_position_embeddings=1024,
        texts=LONG_PROMPTS,
        max_new_tokens=REFERENCE_NEW_TOKENS,
        family=family,
        overrides=FAMILIES[family],
    )
    args = ["--model", str(directory), "--dtype", "float32", "--kv-cache-dtype", "float32"]
    args += ["--chunked-prefill-size", "8", "--max-prefill-tokens", "8", "--block-size", "4"]
    args += ["--torch-threads", "1"] + (["--backend", backend] if backend else [])
    with running_server(args) as server:
        server.refs = references(directory)
        server.family, server.backend = family, backend
        yield server


def test_the_server_names_the_family_and_its_backend(server):
    status, _, raw = request(server.url + "/server_info")
    assert status == 200
    info = json.loads(raw)
    assert info["architecture"] == server.family
    if server.family == "gpt-oss":
        assert "attention sinks" in info["model_features"]
    else:
        assert "q/k norm" in info["model_features"]
    if server.family == "gemma3":
        assert any(f.startswith(f"sliding window {WINDOW}") for f in info["model_features"])
    if server.family == "qwen3moe":
        assert "mixture of experts: top-2 of 8 on 2 layers" in info["model_features"]
    expected = (server.backend,) if server.backend else ("cpu-kernels", "torch")
    assert info["backend"]["name"] in expected and info["backend"]["reason"]


def test_cold_and_cached_prompts_give_hf_tokens(server):
    url = server.url
    assert request(url + "/flush_cache", {})[0] == 200
    for ref in server.refs:
        cold = generate(url, ref["prompt"])
        warm = generate(url, ref["prompt"])  # its prompt's blocks are in the cache now
        assert warm["meta_info"]["cached_tokens"] > 0, warm["meta_info"]
        assert warm["output_ids"] == cold["output_ids"]
        check_against_reference(cold["output_ids"], ref, f"{server.family}: {ref['text']!r}")


def test_a_shared_prefix_from_another_request_gives_hf_tokens(server):
    """The first prompt's blocks serve a second, longer prompt that starts with it."""
    url = server.url
    assert request(url + "/flush_cache", {})[0] == 200
    first, second = server.refs[1], server.refs[0]
    generate(url, first["prompt"][:-1])
    shared = generate(url, first["prompt"])
    assert shared["meta_info"]["cached_tokens"] > 0
    check_against_reference(shared["output_ids"], first, server.family)
    check_against_reference(generate(url, second["prompt"])["output_ids"], second, server.family)
