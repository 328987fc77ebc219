"""The per-token fast paths of serving equal the plain code they replace.

- SSE content chunks rendered from a template cut around the text are byte-for-byte what
  encoding the whole chunk gives (chat and completions, with and without usage, any text);
- the event-loop histogram exports what prometheus-client's Histogram exports;
- the sampler's numpy argmax picks what torch's argmax picks (ties and NaN included).
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pyserve.http.metrics import LoopHistogram
from pyserve.http.openai_format import (
    ChatFormat,
    CompletionFormat,
    ResponseMeta,
    chat_chunk,
    completion_chunk,
)
from pyserve.http.sse import event
from pyserve.outputs import GenerationChunk
from pyserve.worker.sampling import argmax_rows

TRICKY_TEXTS = [
    "",
    "a",
    ' "quoted" ',
    "back\\slash",
    "new\nline\ttab",
    "\x00nul",
    "é世界😀",
    "\ud7ff",
]


def random_texts(rng: random.Random, count: int) -> list[str]:
    alphabet = [chr(c) for c in (*range(0, 128), 0xE9, 0x4E16, 0x1F600, 0x2028)]
    return [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in range(count)
    ]


@pytest.mark.parametrize("include_usage", [False, True])
def test_templated_content_chunks_equal_the_encoded_chunks(include_usage):
    rng = random.Random(7)
    meta = ResponseMeta('id-"\x00', 1234, 'model "\x00" é', include_usage)
    chat = ChatFormat(meta, 2, None)
    completion = CompletionFormat(meta, 2, ["", ""], None)
    for text in TRICKY_TEXTS + random_texts(rng, 200):
        chunk = GenerationChunk("r", text, [1], prompt_tokens=2, completion_tokens=1)
        for index in (0, 1):
            if not text:  # nothing to send
                assert chat.content(index, chunk, None) is None
                assert completion.content(index, chunk, None) is None
                continue
            want_chat = event(chat_chunk(meta, index, {"content": text}))
            assert chat.content(index, chunk, None) == want_chat
            want_completion = event(completion_chunk(meta, index, text))
            assert completion.content(index, chunk, None) == want_completion


def _samples(exposition: bytes, name: str) -> list[str]:
    lines = exposition.decode().splitlines()
    return [x for x in lines if re.match(rf"{name}_(bucket|count|sum)\b", x)]


def test_loop_histogram_exports_what_prometheus_histogram_exports():
    buckets = (0.001, 0.01, 0.1, 1.0)
    values = [0.0, 0.001, 0.0010001, 0.05, 0.1, 0.5, 1.0, 3.0] + [
        random.Random(3).random() for _ in range(100)
    ]
    ours = LoopHistogram("h_seconds", "doc", buckets)
    reference_registry = CollectorRegistry()
    theirs = Histogram("h_seconds", "doc", buckets=buckets, registry=reference_registry)
    for v in values:
        ours.observe(v)
        theirs.observe(v)
    registry = CollectorRegistry()
    registry.register(ours)
    got = _samples(generate_latest(registry), "h_seconds")
    want = _samples(generate_latest(reference_registry), "h_seconds")
    assert got == want and len(got) == len(buckets) + 3


def test_numpy_argmax_picks_what_torch_picks():
    torch.manual_seed(0)
    logits = torch.randn(64, 4096)
    logits[0, :] = 1.0  # all tied: the first
    logits[1, 5] = logits[1, 9] = 100.0  # tied maxima: the first
    logits[2, 7] = float("nan")  # NaN wins, as in torch
    logits[3, :] = float("-inf")
    logits[4, 4095] = 1e30
    got = argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))
    strided = logits[::2, 1:]
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
    half = logits.to(torch.bfloat16)  # other dtypes go through torch
    assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
    assert np.array_equal(got.numpy()[:5], [0, 5, 7, 0, 4095])
