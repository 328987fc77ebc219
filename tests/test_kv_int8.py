"""int8 K/V (``--kv-cache-dtype int8``): the paged cache's quantized storage, its pool sizing,
the flag, a served tiny model, and the Triton backend over it against the torch backend. The
attention backends over an int8 cache: tests/test_model_correctness.py; the CPU kernels:
tests/test_kv_int8_kernels.py; the Triton kernels: tests/test_triton_kernels.py.
More of the worker's end to end: tests/test_worker_offline.py (``int8``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hf_parity import BLOCK_SIZE as PARITY_BLOCK
from hf_parity import Driver, Seq, make_prompts, make_tiny_model
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
    one_torch_thread,
)

from pyserve.cli import build_parser, engine_config
from pyserve.worker.dtypes import kv_bytes_per_token_head
from pyserve.worker.kv_cache import PagedKVCache, dequantize_int8, quantize_int8
from pyserve.worker.model_runner import ModelRunner


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
def parity_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hf_parity's tiny Llama: decisive logits, GQA, 3 layers."""
    directory = tmp_path_factory.mktemp("parity-llama")
    make_tiny_model(directory, "llama")
    return directory


# the Triton backend over int8 K/V against the torch backend's: the same quantization, the same
# attention up to float32 rounding (a rounding that flips one int8 value moves a logprob by less)
TRITON_LOGPROB_TOLERANCE = 0.05


def int8_run(model: Path, backend: str, **options) -> tuple[list[Seq], ModelRunner]:
    """Greedy continuations of six prompts over int8 K/V: the first three prefilled whole, the
    others in chunks beside their decodes, then every request decodes together."""
    runner = load_runner(
        str(model), num_blocks=256, block_size=PARITY_BLOCK, kv_cache_dtype="int8",
        dtype="float32", backend=backend, backend_options=options,
    )  # fmt: skip
    driver = Driver(runner)
    seqs = [driver.new_seq(p) for p in make_prompts(seed=1, count=6)]
    driver.step([(s, s.pending) for s in seqs[:3]])
    rng = random.Random(4)
    while any(s.computed < s.prompt_len for s in seqs[3:]):
        entries = [(s, 1) for s in seqs[:3]]
        entries += [(s, rng.randint(1, s.pending)) for s in seqs[3:] if s.computed < s.prompt_len]
        driver.step(entries)
    for _ in range(12):
        driver.step([(s, 1) for s in seqs])
    return seqs, runner


@pytest.mark.parametrize("decode_graphs", ["off", "eager"])
def test_the_triton_backend_over_int8_kv_follows_the_torch_backend(
    parity_model: Path, decode_graphs: str
) -> None:
    """Greedy tokens equal, every step's logprobs within TRITON_LOGPROB_TOLERANCE; "eager" runs
    the decodes through the decode graphs' static buffers (padded batches, the scratch block)."""
    want, _ = int8_run(parity_model, "torch")
    got, runner = int8_run(parity_model, "triton", decode_graphs=decode_graphs, graph_max_batch=8)
    if decode_graphs == "eager":
        assert runner.backend.graphs.steps == 12  # 6 rows: padded to a graph of 8
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        assert a.tokens == b.tokens
        for row_a, row_b in zip(a.logprobs, b.logprobs, strict=True):
            worst = max(worst, (row_a - row_b).abs().max().item())
    assert worst < TRITON_LOGPROB_TOLERANCE, worst


def test_the_triton_backend_says_it_reads_int8_kv_in_its_kernels(parity_model: Path) -> None:
    runner = load_runner(
        str(parity_model), num_blocks=8, block_size=PARITY_BLOCK, kv_cache_dtype="int8",
        backend="triton",
    )  # fmt: skip
    kernels = runner.backend.info().kernels
    assert kernels["attention"] == "triton, int8 K/V read in the kernels (per-token scales)"
    assert runner.kv_cache.k_scale[0].shape == (9 * PARITY_BLOCK, 2)  # the pool and scratch


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
