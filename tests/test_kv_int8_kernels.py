"""The CPU kernels over an int8 cache (``--kv-cache-dtype int8``): decode attention on every ISA
the CPU runs against a float64 reference over the dequantized values, prefill attention equal
to the float32-cache kernel over the same dequantized values (its key and value tiles are those
values exactly), and the cpu-kernels backend (layer loop and decoder stack) against the torch
backend over the same int8 K/V. The fused rope + KV store: tests/test_layer_ops.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_attention_kernel import BLOCK, CONTEXTS, NUM_BLOCKS, SHAPES, random_tables, reference
from worker_testlib import assert_attention_close, load_runner, make_tiny_llama

from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker import quant
from pyserve.worker.backends.cpu.attention_kernel import (
    paged_decode_attention,
    paged_prefill_attention,
)
from pyserve.worker.kv_cache import dequantize_int8, int8_groups
from pyserve.worker.offline import OfflineEngine

KERNELS = quant.kernels()


# the attention kernels' shapes, and a head_dim of two whole groups of 32 and a half one
INT8_SHAPES = [*SHAPES, (80, 6, 2)]


def int8_cache(kv_heads: int, dim: int, blocks: int, block: int, seed: int):
    """int8 K (dimension-major within a block) and V with their float16 scales, a scale per 32
    values laid out as kv_cache.py's (K's [heads, blocks, groups, block], V's [heads, blocks,
    block, groups]), and the same values dequantized as float32 caches."""
    g = torch.Generator().manual_seed(seed)
    shape = (kv_heads, blocks, block, dim)
    groups = int8_groups(dim)
    k = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    # K's scales large enough for peaked softmaxes, V's spread over two decades, each group of
    # its own so that a group read with another's scale shows
    k_scale = (torch.rand(*shape[:2], groups, block, generator=g) / 20 + 1e-3).half()
    v_scale = (torch.rand(*shape[:3], groups, generator=g).exp() / 100).half()
    k_float = dequantize_int8(k, k_scale.transpose(2, 3))
    v_float = dequantize_int8(v, v_scale)
    k, k_float = k.transpose(2, 3).contiguous(), k_float.transpose(2, 3).contiguous()
    return (k, v, k_scale, v_scale), (k_float, v_float)


@pytest.mark.parametrize("shape", INT8_SHAPES, ids=lambda s: f"dim{s[0]}-h{s[1]}-kv{s[2]}")
def test_decode_reads_int8_on_every_isa(isa, threads, shape):
    dim, heads, kv_heads = shape
    (k, v, k_scale, v_scale), (k_float, v_float) = int8_cache(kv_heads, dim, NUM_BLOCKS, BLOCK, dim)
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(len(CONTEXTS), heads, dim, generator=g)
    tables = random_tables(CONTEXTS, dim)
    lens = torch.tensor(CONTEXTS)
    expected = reference(q, k_float, v_float, tables, CONTEXTS, dim**-0.5)
    for partition in (0, 96):  # the kernel's own split; partitions across blocks and tiles
        out = paged_decode_attention(q, k, v, tables, lens, dim**-0.5, partition_tokens=partition,
                                     k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        assert_attention_close(out, expected, torch.float32, f"{isa} int8 partition={partition}")
    window = paged_decode_attention(q, k, v, tables, lens, dim**-0.5, window=37, softcap=5.0,
                                    k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    capped = reference(q, k_float, v_float, tables, CONTEXTS, dim**-0.5, window=37, softcap=5.0)
    assert_attention_close(window, capped, torch.float32, f"{isa} int8 window + softcap")


@pytest.mark.parametrize("block", [16, 5])
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=lambda s: f"dim{s[0]}-h{s[1]}-kv{s[2]}")
def test_prefill_reads_int8_as_the_dequantized_values(isa, threads, shape, block):
    from test_prefill_attention_kernel import CHUNKS, layout

    dim, heads, kv_heads = shape
    blocks = 300
    (k, v, k_scale, v_scale), (k_float, v_float) = int8_cache(kv_heads, dim, blocks, block, block)
    g = torch.Generator().manual_seed(dim)
    spans = layout(CHUNKS)
    width = max(-(-(s + n) // block) for s, n in CHUNKS) + 1
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in CHUNKS])
    q = torch.randn(int((spans[:, 0] + spans[:, 1]).max()) + 1, heads, dim, generator=g)
    got = paged_prefill_attention(q, k, v, spans, tables, dim**-0.5, k_scale=k_scale,
                                  v_scale=v_scale, window=50)  # fmt: skip
    want = paged_prefill_attention(q, k_float, v_float, spans, tables, dim**-0.5, window=50)
    assert torch.equal(got, want), f"{isa}: {(got - want).abs().max().item():.3e}"


def test_the_kernels_refuse_an_int8_cache_without_its_scales():
    (k, v, k_scale, v_scale), _ = int8_cache(1, 64, 4, 16, 0)
    q, tables, lens = torch.randn(1, 1, 64), torch.tensor([[0, 1]]), torch.tensor([20])
    with pytest.raises(ValueError, match="int8 cache needs its k_scale"):
        paged_decode_attention(q, k, v, tables, lens, 0.125)
    with pytest.raises(ValueError, match="has no scales"):
        paged_decode_attention(q, k.float(), v.float(), tables, lens, 0.125, k_scale=k_scale,
                               v_scale=v_scale)  # fmt: skip
    with pytest.raises(ValueError, match="k_scale must be"):
        paged_decode_attention(q, k, v, tables, lens, 0.125, k_scale=k_scale[:, :2],
                               v_scale=v_scale)  # fmt: skip
    # float16 scales, in their own layouts: K's group-major, V's token-major
    with pytest.raises(ValueError, match=r"k_scale must be a contiguous float16 \[1, 4, 2, 16\]"):
        paged_decode_attention(q, k, v, tables, lens, 0.125, k_scale=k_scale.float(),
                               v_scale=v_scale)  # fmt: skip
    with pytest.raises(ValueError, match=r"v_scale must be a contiguous float16 \[1, 4, 16, 2\]"):
        paged_decode_attention(q, k, v, tables, lens, 0.125, k_scale=k_scale,
                               v_scale=k_scale)  # fmt: skip
    strided = v_scale.transpose(2, 3).contiguous().transpose(2, 3)  # V's shape, not contiguous
    with pytest.raises(ValueError, match="v_scale must be"):
        paged_decode_attention(q, k, v, tables, lens, 0.125, k_scale=k_scale, v_scale=strided)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_cpu_kernels_backend_over_int8_matches_the_torch_backend(tiny_model: Path):
    """Greedy tokens and logprobs of the cpu-kernels backend (its fused rope + int8 store and
    int8 attention), whole-stack and layer by layer, through chunked prefills and decodes: the
    stack equals the layer loop; both follow the torch backend over int8 K/V. Here the two
    backends' logprobs differed by up to 1.4e-3 over float32 K/V (their int8 linears' paths)
    and 2.8e-3 over int8 K/V (where that order moves a value across an int8 rounding
    boundary, one stored value moves by a step of its group's max|x| / 127). A greedy token may
    differ only at a near-tie of the torch backend's (prompt 3's token 22, its top two 0.018
    apart), the logprobs compared up to there; the two backends drift from float32 K/V alike
    (a mean 0.020 both on prompt 0)."""
    from worker_testlib import random_prompts

    prompts = random_prompts(5, [3, 9, 17, 30, 41], 0, shuffle=False)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=2)  # fmt: skip
    outputs = {}
    for backend, stack in (("cpu-kernels", True), ("cpu-kernels", False), ("torch", False)):
        options = {"use_stack": stack} if backend == "cpu-kernels" else {}
        runner = load_runner(str(tiny_model), num_blocks=256, block_size=4, backend=backend,
                             kv_cache_dtype="int8", quantization="int8",
                             backend_options=options)  # fmt: skip
        engine = OfflineEngine(runner=runner, num_blocks=256, block_size=4,
                               chunked_prefill_size=8, max_prefill_tokens=16)  # fmt: skip
        if backend == "cpu-kernels":
            plan = engine.runner.backend.plan
            assert plan.decode_attention and all(p.attention == "kernels" for p in plan.layers)
            assert all(p.rope_kv == "fused" for p in plan.layers) == plan.prefill_attention
            assert (plan.stack == "on") == stack, plan.stack
        outputs[backend, stack] = engine.generate(prompts, greedy)
    stacked, looped, ref = (
        outputs["cpu-kernels", True],
        outputs["cpu-kernels", False],
        outputs["torch", False],
    )
    near_ties = 0
    for i, (a, b, c) in enumerate(zip(stacked, looped, ref, strict=True)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, f"prompt {i}"
        pairs = enumerate(zip(a.token_ids, c.token_ids, strict=True))
        same = next((t for t, (x, y) in pairs if x != y), None)
        if same is not None:
            (_, first), (_, second) = c.top_logprobs[same][:2]
            assert first - second < 0.025, f"prompt {i}: token {same} differs, no near-tie"
            near_ties += 1
        n = len(a.token_ids) if same is None else same
        diff = np.abs(np.subtract(a.logprobs[:n], c.logprobs[:n])).max(initial=0.0)
        assert diff < 5e-3, f"prompt {i}: logprobs moved by {diff:.2e}"
    assert near_ties <= 1
