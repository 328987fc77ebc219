"""``Engine.embed`` and ``Engine.rerank`` end to end, against Hugging Face transformers.

One engine for the module, on a tiny random-weight Llama with SmolLM2's vocabulary, in float32
with no quantization, its prefill chunked at 16 tokens so that long inputs span several steps.
Its directory is named like a reranker, so ``--rerank-mode auto`` scores with its "yes"/"no"
logits; a smaller init range keeps those scores away from 0 and 1. The references come from a
subprocess (tests/embedding_reference.py): this process stays torch-free.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import uvloop
from embedding_reference import hf_embeddings
from tiny_models import build_tiny_smollm

from pyserve import Engine, EngineConfig
from pyserve.engine import ContextLengthExceeded
from pyserve.engine import embeddings as emb
from pyserve.wire.main_to_worker import SamplingParams

TOLERANCE = 1e-5  # float32, whether alone, batched or beside generation
CONTEXT = 256
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, " * 6,  # ~70 tokens: five chunks of 16
    "def fibonacci(n):",
    "Les élèves étudient le 世界",
]
QUERY = "Which animal is quick?"
DOCUMENTS = ["The quick brown fox jumps.", "Paris is a city in France.", "def f(x): return x"]


@pytest.fixture(scope="module")
def model_dir():
    with tempfile.TemporaryDirectory(prefix="pyserve-test-embeddings-") as directory:
        yield build_tiny_smollm(
            Path(directory) / "tiny-reranker",
            seed=3,
            max_position_embeddings=CONTEXT,
            overrides={"initializer_range": 0.02},
        )


@pytest.fixture(scope="module")
def loop():
    loop = uvloop.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(model_dir, loop):
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        kv_cache_tokens=4096,
        chunked_prefill_size=16,
        max_prefill_tokens=48,
        torch_threads=1,
        tokenizer_workers=1,
        log_level="warning",
    )
    engine = loop.run_until_complete(Engine.start(config))
    yield engine
    loop.run_until_complete(engine.shutdown())


@pytest.fixture(scope="module")
def token_ids(engine):
    return [engine.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(engine, model_dir, token_ids):
    yes_no = list(engine.embedding_model.yes_no_ids)
    return hf_embeddings(model_dir, token_ids, yes_no)


def unit(vector) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float64)
    return v / np.linalg.norm(v)


def close(ours, theirs, label: str) -> None:
    gap = float(np.abs(np.asarray(ours, dtype=np.float64) - np.asarray(theirs)).max())
    assert gap <= TOLERANCE, f"{label}: off by {gap:.3g}"


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_each_pooling_equals_transformers_alone_and_in_a_batch(
    engine, loop, reference, token_ids, pooling
):
    async def run():
        alone = [await engine.embed(t, pooling=pooling) for t in TEXTS]
        batch = await asyncio.gather(*[engine.embed(t, pooling=pooling) for t in TEXTS])
        return alone, batch

    alone, batch = loop.run_until_complete(run())
    for i, (a, b, ref) in enumerate(zip(alone, batch, reference, strict=True)):
        close(a.embedding, unit(ref[pooling]), f"{pooling} input {i} alone")
        close(b.embedding, a.embedding, f"{pooling} input {i} batched")
        assert a.prompt_tokens == b.prompt_tokens == len(token_ids[i])
        assert math.isclose(float(np.linalg.norm(a.embedding)), 1.0, rel_tol=1e-6)


def test_an_embedding_beside_generation_is_the_same(engine, loop, reference):
    async def run():
        sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        stream = engine.generate("Tell me a long story", sampling)
        first = await anext(stream)  # generation is running: the embeddings join its steps
        embedded = await asyncio.gather(*[engine.embed(t, pooling="mean") for t in TEXTS])
        rest = [chunk async for chunk in stream]
        return first, embedded, rest

    _, embedded, rest = loop.run_until_complete(run())
    assert rest[-1].finish_reason == "length"
    for i, (e, ref) in enumerate(zip(embedded, reference, strict=True)):
        close(e.embedding, unit(ref["mean"]), f"input {i} beside generation")


def test_last_token_pooling_uses_the_prefix_cache_and_mean_computes_everything(
    engine, loop, reference, token_ids
):
    long = TEXTS[1]

    async def run():
        return [await engine.embed(long, pooling=p) for p in ("last", "last", "mean", "mean")]

    last1, last2, mean1, mean2 = loop.run_until_complete(run())
    assert last2.cached_tokens >= 16, "the second last-token embedding reuses cached blocks"
    assert mean1.cached_tokens == mean2.cached_tokens == 0
    close(last2.embedding, last1.embedding, "last from the cache")
    close(mean2.embedding, unit(reference[1]["mean"]), "mean, computed again")
    assert last1.prompt_tokens == len(token_ids[1])


def test_token_ids_truncation_and_the_context_limit(engine, loop, reference, token_ids):
    ids = token_ids[1]

    async def run():
        by_ids = await engine.embed(ids, pooling="last")
        too_long = ids * (CONTEXT // len(ids) + 1)
        with pytest.raises(ContextLengthExceeded):
            await engine.embed(too_long)
        cut = await engine.embed([7] * 10 + ids, pooling="mean", truncate_prompt_tokens=len(ids))
        whole = await engine.embed(too_long[:CONTEXT], pooling="last")  # fills the context
        return by_ids, cut, whole

    by_ids, cut, whole = loop.run_until_complete(run())
    close(by_ids.embedding, unit(reference[1]["last"]), "token ids")
    close(cut.embedding, unit(reference[1]["mean"]), "truncated to its last tokens")
    assert cut.prompt_tokens == len(ids) and whole.prompt_tokens == CONTEXT


def test_dimensions_are_refused_without_matryoshka_and_nothing_is_submitted(engine, loop):
    async def run():
        # last-token pooling matches prefixes: a request that reached the core would be counted
        # in the cache's query_tokens
        before = (await engine.core_stats())["query_tokens"]
        with pytest.raises(ValueError) as info:
            await engine.embed("hello", dimensions=8, pooling="last")
        with pytest.raises(ValueError):
            await engine.embed("hello", pooling="max")
        with pytest.raises(ValueError):
            await engine.embed([], pooling="last")
        after = (await engine.core_stats())["query_tokens"]
        return info.value, before, after

    error, before, after = loop.run_until_complete(run())
    assert getattr(error, "param", None) == "dimensions"
    assert after == before


def test_yes_no_rerank_scores_equal_transformers(engine, loop, model_dir):
    model = engine.embedding_model
    assert model.rerank_mode == "yes-no" and "reranker" in model.rerank_reason
    tokenizer = engine.tokenizer
    prefix = tokenizer.encode(emb.YES_NO_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(emb.YES_NO_SUFFIX, add_special_tokens=False)
    prompts = [
        prefix
        + tokenizer.encode(emb.yes_no_text(QUERY, d, None), add_special_tokens=False)
        + suffix
        for d in DOCUMENTS
    ]
    refs = hf_embeddings(model_dir, prompts, list(model.yes_no_ids))
    expected = [1 / (1 + math.exp(r["logits"][1] - r["logits"][0])) for r in refs]
    assert max(expected) - min(expected) > 1e-3, "the scores must tell the documents apart"

    result = loop.run_until_complete(engine.rerank(QUERY, DOCUMENTS))
    assert result.prompt_tokens == sum(map(len, prompts))
    for ours, theirs in zip(result.scores, expected, strict=True):
        assert abs(ours - theirs) <= TOLERANCE
    assert np.argsort(result.scores).tolist() == np.argsort(expected).tolist()


def test_describe_reads_matryoshka_dimensions_and_sentence_transformers_pooling(tmp_path):
    class Tokenizer:
        unk_token_id = None

        def convert_tokens_to_ids(self, token):
            return {"yes": 5, "no": 6}.get(token)

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3ForCausalLM"], "matryoshka_dimensions": [8, 32]})
    )
    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True})
    )
    common = {"path": str(tmp_path), "kind": "hf", "hidden_size": 64, "tokenizer": Tokenizer()}
    model = emb.describe(
        name="Qwen3-Reranker-0.6B", pooling=None, normalize=True, rerank_mode="auto", **common
    )
    assert model.pooling == "cls" and model.matryoshka_dimensions == (8, 32)
    assert model.rerank_mode == "yes-no" and model.yes_no_ids == (5, 6)
    model.check_dimensions(8)
    with pytest.raises(ValueError):
        model.check_dimensions(16)
    plain = emb.describe(name="m", pooling="last", normalize=True, rerank_mode="auto", **common)
    assert plain.pooling == "last" and plain.rerank_mode == "cosine"
    # a Matryoshka cut renormalizes what is left
    raw = np.asarray([3.0, 4.0, 12.0], dtype="<f4").tobytes()
    assert emb.finish_vector(raw, 2, True) == pytest.approx([0.6, 0.8])
    assert emb.finish_vector(raw, None, False) == [3.0, 4.0, 12.0]
