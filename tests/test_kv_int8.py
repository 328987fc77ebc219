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


def test_quantize_int8_rounds_each_group_of_32_to_its_own_scale() -> None:
    # three groups of 32 per row, each of its own magnitude: a group's scale follows its own
    # range, not the head's
    x = torch.randn(5, 3, 96) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(32)
    x[0, 0, :32] = 0.0  # an all-zero group: scale 0, values 0, no NaN
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (5, 3, 3)
    assert scale[0, 0, 0] == 0 and (q[0, 0, :32] == 0).all()
    live = scale > 0
    assert (q.unflatten(-1, (3, 32)).abs().amax(dim=-1)[live] >= 126).all()  # each uses the range
    assert (scale[..., 2].float() > 100 * scale[..., 1].float()).all()
    back = dequantize_int8(q, scale)
    assert torch.isfinite(back).all()
    half_step = scale.float().repeat_interleave(32, dim=-1) / 2
    assert ((back - x).abs() <= half_step * (1 + 1e-3) + 1e-6).all()


def test_quantize_int8_takes_a_head_dim_that_is_not_a_multiple_of_32() -> None:
    x = torch.randn(4, 2, 80)
    x[..., 64:] *= 1000.0  # the short last group (16 values) has a scale of its own
    q, scale = quantize_int8(x)
    assert q.shape == x.shape and scale.shape == (4, 2, 3)
    whole = torch.nn.functional.pad(x, (0, 16))
    q_whole, scale_whole = quantize_int8(whole)  # as if zero-padded to 96
    assert torch.equal(q, q_whole[..., :80]) and torch.equal(scale, scale_whole)
    assert (dequantize_int8(q, scale) - x).abs().max() <= scale.float().max() / 2 * (1 + 1e-3)


def test_quantize_int8_keeps_float16_range_and_underflow() -> None:
    x = torch.zeros(3, 32)
    x[0, 0] = 1e9  # its scale saturates at float16's largest: values clamp at ±127, no inf
    x[1, 0] = 1e-9  # its scale underflows float16: values 0, as a float16 cache loses them
    x[2] = torch.linspace(-1, 1, 32)
    q, scale = quantize_int8(x)
    assert scale[0, 0] == 65504.0 and q[0, 0] == 127
    assert scale[1, 0] == 0 and (q[1] == 0).all()
    # the values are divided by the scale as stored (float16), not by max|x| / 127
    stored = scale[2, 0].float()
    expected = torch.round(x[2] * (1.0 / stored)).clamp(-127, 127)
    assert torch.equal(q[2].float(), expected)


def test_int8_cache_reads_back_what_write_returns() -> None:
    torch.manual_seed(0)
    cache = PagedKVCache(
        num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=40, dtype=torch.int8
    )
    # laid out as K and V are, a group (of up to 32 values) in place of 32 dimensions
    assert cache.k_scale[1].shape == (2, 6, 2, 4) and cache.v_scale[1].shape == (2, 6, 4, 2)
    assert cache.k_scale[1].dtype == cache.v_scale[1].dtype == torch.float16
    slots = torch.tensor([5, 6, 7, 8, 21, 0])  # across blocks, out of order
    k, v = torch.randn(6, 2, 40), torch.randn(6, 2, 40) * 10
    k_stored, v_stored = cache.write(1, slots, k, v)
    assert (k_stored - k).abs().max() < k.abs().max() / 127
    keys, values = cache.gather(1, torch.tensor([1, 2, 5, 0]))  # [heads, 4 blocks, 4, 40]
    blocks = {1: 0, 2: 1, 5: 2, 0: 3}
    for t, slot in enumerate(slots.tolist()):
        b, off = blocks[slot // 4], slot % 4
        torch.testing.assert_close(keys[:, b, off], k_stored[t], rtol=0, atol=0)
        torch.testing.assert_close(values[:, b, off], v_stored[t], rtol=0, atol=0)
        # the scales sit where the layout says: K's group-major, V's token-major
        _, k_scale = quantize_int8(k[t])
        _, v_scale = quantize_int8(v[t])
        assert torch.equal(cache.k_scale[1][:, slot // 4, :, off], k_scale)
        assert torch.equal(cache.v_scale[1][:, slot // 4, off, :], v_scale)
    assert (cache.k[0] == 0).all() and (cache.k_scale[0] == 0).all()  # other layers untouched
    # values and scales: (40 + 2 · 2) bytes a (token, head) of K and of V
    assert kv_bytes_per_token_head("int8", 40) == 44
    assert cache.nbytes == 2 * 2 * 2 * 6 * 4 * kv_bytes_per_token_head("int8", 40)


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


@pytest.fixture(scope="module")
def parity_model_head80(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with heads of 80 dims: int8 groups of 32, 32 and 16, in kernel tiles of 128."""
    directory = tmp_path_factory.mktemp("parity-llama-head80")
    make_tiny_model(directory, "llama", head_dim=80)
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


@pytest.mark.parametrize(
    "model, decode_graphs",
    [("parity_model", "off"), ("parity_model", "eager"), ("parity_model_head80", "off")],
)
def test_the_triton_backend_over_int8_kv_follows_the_torch_backend(
    model: str, decode_graphs: str, request: pytest.FixtureRequest
) -> None:
    """Greedy tokens equal, every step's logprobs within TRITON_LOGPROB_TOLERANCE; "eager" runs
    the decodes through the decode graphs' static buffers (padded batches, the scratch block)."""
    directory: Path = request.getfixturevalue(model)
    want, _ = int8_run(directory, "torch")
    got, runner = int8_run(directory, "triton", decode_graphs=decode_graphs, graph_max_batch=8)
    if decode_graphs == "eager":
        assert runner.backend.graphs.steps == 12  # 6 rows: padded to a graph of 8
    if model == "parity_model_head80":
        assert runner.kv_cache.k_scale[0].shape[-1] == 3
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
    assert kernels["attention"] == "triton, int8 K/V read in the kernels (a scale per 32 values)"
    # the pool and scratch, a float16 scale per 32 values of each kv head
    groups = -(-runner.config.head_dim // 32)
    for scales in (runner.kv_cache.k_scale[0], runner.kv_cache.v_scale[0]):
        assert scales.shape == (9 * PARITY_BLOCK, 2, groups) and scales.dtype == torch.float16


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
