"""int8 K/V (``--kv-cache-dtype int8``): the paged cache's quantized storage, its pool sizing,
the torch backend reading it, and the backends that do not read it refusing it at start.
More of the worker's end to end: tests/test_worker_offline.py (``int8``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from http_testlib import (
    REFERENCE_NEW_TOKENS,
    kv_idle,
    references,
    request,
    running_server,
    wait_for_metrics,
)
from http_testlib import tiny_model as http_tiny_model
from worker_testlib import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    load_runner,
    make_tiny_llama,
    one_torch_thread,
    paged_batch,
)

from pyserve.cli import build_parser, engine_config
from pyserve.worker.backends import attention_backend
from pyserve.worker.backends.base import AttentionLayer
from pyserve.worker.dtypes import kv_bytes_per_token_head
from pyserve.worker.kv_cache import PagedKVCache, dequantize_int8, quantize_int8


def test_quantize_int8_rounds_each_row_to_its_own_scale() -> None:
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0, no NaN
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 3)
    assert scale[0, 0] == 0 and (q[0, 0] == 0).all()
    assert (q.abs().amax(dim=-1)[scale > 0] == 127).all()  # the largest value uses the range
    back = dequantize_int8(q, scale)
    assert torch.isfinite(back).all()
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()


def test_int8_cache_reads_back_what_write_returns() -> None:
    torch.manual_seed(0)
    cache = PagedKVCache(
        num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.int8
    )
    assert cache.k_scale[1].shape == cache.v_scale[1].shape == (2, 6, 4)
    slots = torch.tensor([5, 6, 7, 8, 21, 0])  # across blocks, out of order
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8) * 10
    k_stored, v_stored = cache.write(1, slots, k, v)
    assert (k_stored - k).abs().max() < k.abs().max() / 127
    keys, values = cache.gather(1, torch.tensor([1, 2, 5, 0]))  # [heads, 4 blocks, 4, 8]
    blocks = {1: 0, 2: 1, 5: 2, 0: 3}
    for t, slot in enumerate(slots.tolist()):
        b, off = blocks[slot // 4], slot % 4
        torch.testing.assert_close(keys[:, b, off], k_stored[t], rtol=0, atol=0)
        torch.testing.assert_close(values[:, b, off], v_stored[t], rtol=0, atol=0)
    assert (cache.k[0] == 0).all() and (cache.k_scale[0] == 0).all()  # other layers untouched
    # values and scales: (8 + 4) bytes a (token, head) of K and of V
    assert cache.nbytes == 2 * 2 * 2 * 6 * 4 * kv_bytes_per_token_head("int8", 8)


def test_cli_takes_int8() -> None:
    args = build_parser().parse_args(["run", "--kv-cache-dtype", "int8"])
    assert engine_config(args).resolved_kv_cache_dtype() == "int8"
    assert kv_bytes_per_token_head("int8", 64) == 68
    assert kv_bytes_per_token_head("float16", 64) == 128


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def dense_attention(q, keys, values, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., keys/values [start + n, KVH, D], in float64."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).double()
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).double()
    scores = q.transpose(0, 1).double() @ k.transpose(1, 2) * dim**-0.5
    allowed = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def fill_int8(cache: PagedKVCache, gen: torch.Generator) -> None:
    for t in cache.k + cache.v:
        t.copy_(torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8))
    for t in cache.k_scale + cache.v_scale:
        t.copy_(torch.rand(t.shape, generator=gen) / 64)


@pytest.mark.parametrize("dtype, max_chunk_tokens, tol", [
    (torch.float32, None, 1e-5), (torch.float32, 8, 1e-5), (torch.bfloat16, 12, 3e-2),
], ids=["fp32-one-chunk", "fp32-split-chunks", "bf16-split-chunks"])  # fmt: skip
def test_torch_backend_attends_to_exactly_the_stored_int8(dtype, max_chunk_tokens, tol) -> None:
    """Mixed batch over an int8 cache (fresh prefills, prefills after a prefix, decodes split
    across chunks): equal to dense attention over the dequantized values, the new tokens'
    included as stored (so a later read sees what this forward attended to)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 6, 2, 16, 4
    backend = attention_backend(
        "torch", heads=heads, kv_heads=kv_heads, dim=dim, num_layers=2, num_blocks=200,
        block_size=block, dtype=dtype, kv_dtype=torch.int8, max_chunk_tokens=max_chunk_tokens,
    )  # fmt: skip
    cache = backend.kv_cache
    fill_int8(cache, gen)
    shapes = [(37, 1), (0, 9), (12, 7), (5, 1), (0, 1), (61, 1), (23, 3), (2, 1)]
    tables, batch = paged_batch(shapes, block, 200, gen)
    total = batch.input_ids.numel()
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    prefixes = []
    for (s, _), table in zip(shapes, tables, strict=True):
        keys, values = cache.gather(1, torch.tensor(table))
        prefixes.append((keys.flatten(1, 2)[:, :s], values.flatten(1, 2)[:, :s]))
    layer = AttentionLayer(1, heads, kv_heads, dim, dim**-0.5)
    out = backend.attend_qkv(layer, q, k, v, backend.prepare(batch))
    assert out.shape == q.shape and out.dtype == dtype
    row = 0
    for (s, n), (pk, pv), table in zip(shapes, prefixes, tables, strict=True):
        keys, values = cache.gather(1, torch.tensor(table))  # the new tokens as stored
        stored_k = keys.flatten(1, 2)[:, s : s + n].transpose(0, 1)
        stored_v = values.flatten(1, 2)[:, s : s + n].transpose(0, 1)
        assert (stored_k - k[row : row + n].float()).abs().max() <= k.float().abs().max() / 127
        expected = dense_attention(
            q[row : row + n],
            torch.cat([pk.transpose(0, 1), stored_k]),
            torch.cat([pv.transpose(0, 1), stored_v]),
            s,
        )
        err = (out[row : row + n].double() - expected).abs().max().item()
        assert err < tol, f"entry start={s} n={n}: error {err:.2e}"
        row += n


def test_the_triton_backend_refuses_int8_at_start(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="int8 runs on the torch and cpu-kernels backends"):
        load_runner(str(tiny_model), backend="triton", kv_cache_dtype="int8", num_blocks=8)


# this tiny model's greedy logprobs over int8 K/V (torch backend) moved by up to 0.151 from HF's
# over float32 K/V: the tiny models' peaked logits magnify the rounding
HTTP_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    directory = http_tiny_model(tmp_path_factory.getbasetemp())
    args = ["--model", str(directory), "--dtype", "float32", "--kv-cache-dtype", "int8"]
    args += ["--backend", "torch", "--kv-cache-tokens", "1024", "--block-size", "2"]
    # 4-token chunks: every prompt is prefilled in several
    args += ["--chunked-prefill-size", "4", "--max-prefill-tokens", "4"]
    args += ["--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        server.refs = references(directory)
        yield server


def generate(url: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": REFERENCE_NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    status, _, raw = request(url + "/generate", body)
    assert status == 200, raw
    return json.loads(raw)


def test_served_int8_kv_follows_float32_within_the_drift_and_leaves_kv_idle(server) -> None:
    """Chunked prefills, then the same prompts again from the prefix cache (reading back int8
    values and scales): greedy tokens are HF's (float32 K/V) except where HF's top two are
    within the drift, logprobs within HTTP_TOLERANCE of HF's; cached runs equal cold ones."""
    url = server.url
    status, _, raw = request(url + "/server_info")
    assert status == 200 and json.loads(raw)["kv_cache"]["dtype"] == "int8"
    worst = 0.0
    for ref in server.refs:
        cold = generate(url, ref["prompt"])
        warm = generate(url, ref["prompt"])
        assert warm["meta_info"]["cached_tokens"] > 0, warm["meta_info"]
        assert warm["output_ids"] == cold["output_ids"]
        ids = cold["output_ids"]
        pairs = enumerate(zip(ids, ref["output"], strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(ids))
        if same < len(ids):
            assert ref["gaps"][same] < 2 * HTTP_TOLERANCE, (ref["text"], same)
        got = [lp[0] for lp in cold["meta_info"]["output_token_logprobs"][:same]]
        moved = [abs(a - b) for a, b in zip(got, ref["logprobs"][:same], strict=True)]
        worst = max([worst, *moved])
    assert worst < HTTP_TOLERANCE, worst
    wait_for_metrics(url, kv_idle)
