"""Gemma 3 with images, end to end: `pyserve run` on a tiny random Gemma 3 (SigLIP, the pooling
projector, a local and a global layer; ``vision_models.py``) answers as transformers' generate
does with its own processor, whose prefill lets each image's positions attend to each other both
ways (within the local layer's window, which ends at each position's own). The tiny model's attention is sharp so that the two-way attention moves the logprobs by
~4e-5: the tolerance here (1e-5) tells it from causal attention. A server per backend: the CPU
kernels, the torch backend with prefill chunks that end right after an image, and Triton's
kernels (in its interpreter).
"""

from __future__ import annotations

import base64
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from http_testlib import kv_idle, openai_client, running_server, wait_for_metrics
from tokenizers import Tokenizer
from vision_models import TOP_LOGPROBS, build_tiny_vlm, random_picture

MAX_NEW = 8
ATOL = 1e-5  # causal attention over the image is ~4e-5 off
QUESTION = "What is in this picture?"
CASES = [
    {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        ],
        "images": [[100, 150, 1]],
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image"},
                    {"type": "text", "text": "and"},
                    {"type": "image"},
                ],
            }
        ],
        "images": [[40, 50, 2], [64, 64, 3]],
    },
]
# the local layer's window: shorter than an image (16 positions), whose rows then see from
# their own position's window to the image's end
SLIDING_WINDOW = 8
BACKENDS = {
    "cpu": [],
    # 24-token chunks: the first ends two positions after the first image
    "torch-chunked": ["--backend", "torch", "--chunked-prefill-size", "24"],
    "triton": ["--backend", "triton"],  # the interpreter (conftest.py sets TRITON_INTERPRET)
}


@pytest.fixture(scope="module")
def model():
    with tempfile.TemporaryDirectory(prefix="pyserve-test-gemma3-images-") as directory:
        yield build_tiny_vlm(
            Path(directory) / "tiny-gemma3",
            family="gemma3",
            seed=0,
            cases=CASES,
            max_new_tokens=MAX_NEW,
            sliding_window=SLIDING_WINDOW,
        )


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


def data_url(height: int, width: int, seed: int) -> str:
    out = io.BytesIO()
    random_picture(height, width, seed).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


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
        model="tiny-gemma3",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("case", range(len(CASES)))
def test_images_are_answered_as_transformers_answers_them(server, references, tokenizer, case):
    out = ask(server, content_of(CASES[case]))
    reference = references[case]
    assert out.usage.prompt_tokens == len(reference["prompt"])
    text = tokenizer.decode(reference["output"], skip_special_tokens=True)
    assert out.choices[0].message.content == text
    ours = [[t.logprob for t in p.top_logprobs] for p in out.choices[0].logprobs.content]
    np.testing.assert_allclose(ours, reference["top_logprobs"], atol=ATOL)


def test_the_same_image_again_is_a_prefix_hit_with_the_same_answer(server, references):
    content = content_of(CASES[0])
    first = ask(server, content)
    again = ask(server, content)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    top = [[t.logprob for t in p.top_logprobs] for p in again.choices[0].logprobs.content]
    np.testing.assert_allclose(top, references[0]["top_logprobs"], atol=ATOL)


def test_nothing_is_left_behind(server):
    wait_for_metrics(server.url, kv_idle)
