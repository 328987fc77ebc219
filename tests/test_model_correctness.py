"""The worker's model against Hugging Face transformers: greedy tokens and logprobs, float32.

Tiny random-weight models (hf_parity.py) are checked in each situation the core produces — a
request alone, mixed prefill + decode batches, prefix-cache hits, chunked prefill — against HF
``generate`` on the same weights; the other families' features: test_model_families.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_parity import (
    BLOCK_SIZE,
    NEAR_TIE,
    NEW_TOKENS,
    TINY,
    Driver,
    Seq,
    assert_all_match,
    hf_greedy,
    make_prompts,
    make_tiny_model,
    prefix_hits,
)
from worker_testlib import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    load_runner,
    one_torch_thread,
    paged_batch,
)

from pyserve.testing.kv_fill import fill_random
from pyserve.worker.backends import attention_backend

# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_model(directory, "llama")
    prompts = make_prompts(seed=1)
    refs = hf_greedy(model, prompts)
    runner = load_runner(str(directory), num_blocks=1024, block_size=BLOCK_SIZE)
    return runner, prompts, refs


def test_references_are_decisive(llama):
    """The tiny model's greedy choices are not near-ties, and its output is not one token."""
    _, _, refs = llama
    gaps = torch.cat([r.logprobs.topk(2, dim=-1).values.diff(dim=-1).neg() for r in refs])
    assert (gaps < NEAR_TIE).float().mean() < 0.02
    for ref in refs:
        assert len(set(ref.tokens)) >= 4, ref.tokens


def test_alone(llama):
    runner, prompts, refs = llama
    driver = Driver(runner)
    for prompt, ref in zip(prompts, refs, strict=True):
        seq = driver.new_seq(prompt)
        driver.step([(seq, len(prompt))])
        driver.run_decodes([seq])
        assert_all_match([seq], [ref])


def test_batched_mixed_prefill_and_decode(llama):
    """Request i is admitted at step i, so each forward mixes one prefill with i decodes."""
    runner, prompts, refs = llama
    driver = Driver(runner)
    seqs: list[Seq] = []
    for prompt in prompts:
        decodes = [(s, 1) for s in seqs]
        seqs.append(driver.new_seq(prompt))
        driver.step([*decodes[:2], (seqs[-1], len(prompt)), *decodes[2:]])
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


def test_prefix_cache_hit(llama):
    """A request reuses blocks an earlier request wrote for the same leading tokens."""
    runner, prompts, refs = llama
    driver = Driver(runner)
    seqs = prefix_hits(driver, prompts, seed=3)
    # all the hits prefill in one forward, then decode together
    driver.step([(s, s.pending) for s in seqs])
    assert any(s.prompt_len - (s.prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE > 1 for s in seqs)
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


def test_chunked_prefill(llama):
    """Prompts cut at random points, chunks of several requests interleaved with decodes."""
    runner, prompts, refs = llama
    driver = Driver(runner)
    rng = random.Random(5)
    seqs = [driver.new_seq(p) for p in prompts]
    while any(len(s.generated) < NEW_TOKENS for s in seqs):
        entries = []
        for seq in seqs:
            if len(seq.generated) >= NEW_TOKENS or rng.random() < 0.3:
                continue  # not scheduled this step
            prefilling = seq.computed < seq.prompt_len
            n = rng.randint(1, seq.pending) if prefilling else 1
            entries.append((seq, n))
        if entries:
            rng.shuffle(entries)
            driver.step(entries)
    assert_all_match(seqs, refs)


# ---------------------------------------------------------------------------- attention alone


def dense_attention(q, keys, values, start: int) -> torch.Tensor:
    """Reference: q [n, H, D] at positions start.., keys/values [start + n, KVH, D]."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = q.transpose(0, 1).float() @ k.transpose(1, 2) * dim**-0.5  # [H, n, L]
    allowed = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("kind", ["cpu-kernels", "torch"])
@pytest.mark.parametrize(
    "dtype, kv, max_chunk_tokens, tol",
    [
        (torch.float32, None, None, 1e-5),
        (torch.float32, None, 8, 1e-5),
        (torch.bfloat16, None, 12, 3e-2),
        (torch.float32, torch.int8, None, 1e-5),
        (torch.float32, torch.int8, 8, 1e-5),
        (torch.bfloat16, torch.int8, 12, 3e-2),
    ],
    ids=["fp32-one-chunk", "fp32-split-chunks", "bf16-split-chunks", "int8-kv-one-chunk",
         "int8-kv-split-chunks", "bf16-int8-kv-split-chunks"],
)  # fmt: skip
def test_attention_backend_matches_dense(dtype, kv, max_chunk_tokens, tol, kind):
    """Mixed batch: fresh prefills, prefills after a prefix, 1-token chunks, long decodes; each
    entry's new K/V as the cache stores them (an int8 cache: dequantized, the values and scales
    a later read sees)."""
    from pyserve.worker.backends.base import AttentionLayer

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 6, 2, 16, 4
    # the torch path's chunks; the kernel splits its own
    backend = attention_backend(
        kind, heads=heads, kv_heads=kv_heads, dim=dim, num_layers=2, num_blocks=200,
        block_size=block, dtype=dtype, kv_dtype=kv, max_chunk_tokens=max_chunk_tokens,
    )  # fmt: skip
    assert backend.name == kind
    cache = backend.kv_cache
    fill_random(cache, gen)
    # (start_pos, num_tokens) per entry
    shapes = [(37, 1), (0, 9), (12, 7), (5, 1), (0, 1), (61, 1), (23, 3), (2, 1)]
    tables, batch = paged_batch(shapes, block, 200, gen)
    total = batch.input_ids.numel()
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    # what the cache holds before the forward, per entry (its cached prefix)
    prefixes = []
    for (s, _), table in zip(shapes, tables, strict=True):
        keys, values = cache.gather(1, torch.tensor(table))
        prefixes.append((keys.flatten(1, 2)[:, :s], values.flatten(1, 2)[:, :s]))
    layer = AttentionLayer(1, heads, kv_heads, dim, dim**-0.5)
    out = backend.attend_qkv(layer, q, k, v, backend.prepare(batch))
    assert out.shape == q.shape and out.dtype == dtype
    row = 0
    for (s, n), (pk, pv), table in zip(shapes, prefixes, tables, strict=True):
        new_k, new_v = k[row : row + n], v[row : row + n]
        if kv is not None:  # the new tokens as stored
            keys, values = cache.gather(1, torch.tensor(table))
            new_k = keys.flatten(1, 2)[:, s : s + n].transpose(0, 1)
            new_v = values.flatten(1, 2)[:, s : s + n].transpose(0, 1)
            assert (new_k - k[row : row + n].float()).abs().max() <= k.float().abs().max() / 127
        keys = torch.cat([pk.transpose(0, 1), new_k.to(pk.dtype)])
        values = torch.cat([pv.transpose(0, 1), new_v.to(pv.dtype)])
        expected = dense_attention(q[row : row + n], keys, values, s)
        err = (out[row : row + n].float() - expected).abs().max().item()
        assert err < tol, f"entry start={s} n={n}: error {err:.2e}"
        row += n
    if kv is None:
        assert (cache.k[0] != 0).all(), "layer 0 must be untouched"  # random init has no zeros


def test_decode_split_across_chunks_matches_hf(llama):
    """The torch split-softmax decode path (contexts spanning several chunks) against HF."""
    runner, prompts, refs = llama
    # 12-token chunks: every context spans several (the kernels split contexts their own way)
    split = load_runner(
        runner.settings.model, num_blocks=1024, block_size=BLOCK_SIZE, backend="torch",
        backend_options={"max_chunk_tokens": 12},
    )  # fmt: skip
    driver = Driver(split)
    seqs = [driver.new_seq(p) for p in prompts]
    driver.step([(s, s.pending) for s in seqs])
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.5},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_frequencies_match_transformers(tmp_path, scaling):
    """Inverse frequencies read from config.json equal transformers' for each rope type."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pyserve.model_files import resolve_model
    from pyserve.worker.loading.hf import read_hf_config
    from pyserve.worker.rope import inverse_frequencies

    overrides = {"rope_scaling": scaling} if scaling else {}
    hf_config = transformers.LlamaConfig(**{**TINY, "rope_theta": 50000.0, **overrides})
    hf_config.save_pretrained(tmp_path)
    _, config = read_hf_config(resolve_model(str(tmp_path)))
    ours, _ = inverse_frequencies(config.layers[0].rope)
    if scaling is None:
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
        theirs = rotary.inv_freq
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    assert torch.equal(ours, theirs.float())
