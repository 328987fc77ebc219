"""Vision families with images, end to end: `pyserve run` on tiny random models
(``vision_models.py``) answers as transformers' generate does with its own processing:

- Gemma 3 (SigLIP, the pooling projector, a local and a global layer), whose prefill lets each
  image's positions attend to each other both ways (within the local layer's window, which ends
  at each position's own). Its attention is sharp so that the two-way attention moves the
  logprobs by ~4e-5: the tolerance (1e-5) tells it from causal attention.
- Qwen2.5-VL (the window-attention ViT, the patch merger), whose rope is multimodal: an image's
  positions lie on its patch grid and later tokens are shifted by the grid's saving.

A server per family and backend: the CPU kernels, the torch backend with prefill chunks that
end right after an image, the torch backend with chunks shorter than an image (the planner keeps
each image in one chunk: its positions are whole spans), and Triton's kernels (in its
interpreter).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from http_testlib import kv_idle, openai_client, running_server, wait_for_metrics
from tokenizers import Tokenizer
from vision_models import IMAGE_CASES, TOP_LOGPROBS, build_tiny_vlm, data_url

MAX_NEW = 8
# per family: its tolerance, and what the builder takes
FAMILIES = {
    "gemma3": (1e-5, {"sliding_window": 8}),  # causal attention over the image is ~4e-5 off
    "qwen2_5_vl": (1e-4, {}),
}
CASES = IMAGE_CASES
# Gemma 3's local window (8) is shorter than its images (16 positions), whose rows then see from
# their own position's window to the image's end
BACKENDS = {
    "cpu": [],
    # 24-token chunks: Gemma 3's first ends two positions after its first image
    "torch-chunked": ["--backend", "torch", "--chunked-prefill-size", "24"],
    # 6-token chunks, shorter than an image: the planner keeps each image in one chunk anyway
    "torch-split": ["--backend", "torch", "--chunked-prefill-size", "6"],
    "triton": ["--backend", "triton"],  # the interpreter (conftest.py sets TRITON_INTERPRET)
}


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="pyserve-test-image-families-") as directory:
        yield Path(directory)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(workdir, family) -> Path:
    options = FAMILIES[family][1]
    return build_tiny_vlm(
        workdir / family, family=family, seed=0, cases=CASES, max_new_tokens=MAX_NEW, **options
    )


@pytest.fixture(scope="module")
def atol(family) -> float:
    return FAMILIES[family][0]


@pytest.fixture(scope="module")
def references(model) -> list[dict]:
    return json.loads((model / "references.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


@pytest.fixture(scope="module", params=list(BACKENDS))
def server(request, model):
    args = ["--model", str(model), "--kv-cache-dtype", "float32", "--kv-cache-tokens", "4096"]
    args += ["--torch-threads", "1", "--tokenizer-workers", "1", *BACKENDS[request.param]]
    with running_server(args) as server:
        yield server


def content_of(case: dict) -> list[dict]:
    """A case's message content as the openai SDK sends it."""
    pictures = iter(case["images"])
    return [
        {"type": "image_url", "image_url": {"url": data_url(*next(pictures))}}
        if part["type"] == "image"
        else part
        for part in case["messages"][0]["content"]
    ]


def ask(server, content: list[dict]):
    return openai_client(server).chat.completions.create(
        model=server.args[1].rsplit("/", 1)[-1],
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("case", range(len(CASES)))
def test_images_are_answered_as_transformers_answers_them(
    server, references, tokenizer, atol, case
):
    out = ask(server, content_of(CASES[case]))
    reference = references[case]
    assert out.usage.prompt_tokens == len(reference["prompt"])
    text = tokenizer.decode(reference["output"], skip_special_tokens=True)
    assert out.choices[0].message.content == text
    ours = [[t.logprob for t in p.top_logprobs] for p in out.choices[0].logprobs.content]
    np.testing.assert_allclose(ours, reference["top_logprobs"], atol=atol)


def test_the_same_image_again_is_a_prefix_hit_with_the_same_answer(server, references, atol):
    content = content_of(CASES[0])
    first = ask(server, content)
    again = ask(server, content)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    top = [[t.logprob for t in p.top_logprobs] for p in again.choices[0].logprobs.content]
    np.testing.assert_allclose(top, references[0]["top_logprobs"], atol=atol)


def test_another_picture_moves_the_logprobs(server, references):
    """The image reaches the text model: random weights may keep the greedy ids, not the
    logprobs."""
    content = content_of(CASES[0])
    content[0] = {"type": "image_url", "image_url": {"url": data_url(100, 150, 77)}}
    out = ask(server, content)
    top = [[t.logprob for t in p.top_logprobs] for p in out.choices[0].logprobs.content]
    assert np.abs(np.array(top) - np.array(references[0]["top_logprobs"])).max() > 1e-3


def test_nothing_is_left_behind(server):
    wait_for_metrics(server.url, kv_idle)
