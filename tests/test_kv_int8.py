"""int8 K/V (``--kv-cache-dtype int8``): the paged cache's quantized storage, its pool sizing,
the flag, a served tiny model, and the Triton backend refusing it at start. The attention
backends over an int8 cache: tests/test_model_correctness.py; the CPU kernels:
tests/test_kv_int8_kernels.py.
More of the worker's end to end: tests/test_worker_offline.py (``int8``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from http_testlib import (
    generate,
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
)

from pyserve.cli import build_parser, engine_config
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


def test_served_int8_kv_follows_float32_within_the_drift_and_leaves_kv_idle(server) -> None:
    """Chunked prefills, then the same prompts again from the prefix cache (reading back int8
    values and scales): greedy tokens are HF's (float32 K/V) except where HF's top two are
    within the drift, logprobs within HTTP_TOLERANCE of HF's; cached runs equal cold ones."""
    url = server.url
    status, _, raw = request(url + "/server_info")
    assert status == 200 and json.loads(raw)["kv_cache"]["dtype"] == "int8"
    worst = 0.0
    for ref in server.refs:
        cold = generate(url, ref["prompt"], return_logprob=True)
        warm = generate(url, ref["prompt"], return_logprob=True)
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
