"""The Triton backend's grouped-expert matmuls (backends/triton/experts.py) against the base
backend's loop over the experts, in Triton's interpreter (conftest.py): a decode token, many
tokens over several row tiles an expert, and routing that leaves experts idle, with float and
8-/4-bit experts; and the stacks that replace the experts' own weights."""

from __future__ import annotations

import pytest
import torch

from pyserve.worker.backends.base import Backend
from pyserve.worker.backends.triton.backend import TritonBackend
from pyserve.worker.backends.triton.experts import TritonExperts, group_by_expert
from pyserve.worker.backends.triton.quant_matmul import TritonQuantLinear
from pyserve.worker.models.config import MoEConfig
from pyserve.worker.models.moe import SparseMoE
from pyserve.worker.quant import quantize_weight

HIDDEN, WIDTH, EXPERTS, TOP_K = 64, 48, 8, 2


def tiny_moe(bits: int = 0, seed: int = 0) -> SparseMoE:
    """Float experts (``bits`` 0), or each projection quantized to ``bits`` as the Triton
    backend loads a quantized file's."""
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_size=WIDTH, normalize_top_k=True)
    moe = SparseMoE(HIDDEN, config, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    for param in moe.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    if bits:
        for expert in moe.experts:
            for name in ("gate_up_proj", "down_proj"):
                packed = quantize_weight(getattr(expert, name).weight, bits)
                layer = TritonQuantLinear(packed, None, dtype=torch.float32, device="cpu")
                setattr(expert, name, layer)
    return moe


@pytest.fixture(scope="module")
def backend() -> TritonBackend:
    # its ops only: no model config, cache or model
    return TritonBackend(None, torch.device("cpu"))  # type: ignore[arg-type]


def routed(tokens: int, choices: list[list[int]] | None = None, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    if choices is None:
        experts = torch.stack(
            [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]
        )
    else:
        experts = torch.tensor(choices)
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return x, weights / weights.sum(-1, keepdim=True), experts


def check_against_the_loop(backend: TritonBackend, x, weights, experts, bits: int = 0) -> None:
    moe = tiny_moe(bits)
    want = Backend.run_experts(backend, moe, x, weights, experts, "silu")
    kernels = TritonExperts.of(moe)
    assert kernels is not None
    got = kernels.run(x, weights, experts, "silu", backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


BITS = pytest.mark.parametrize("bits", [0, 8, 4], ids=["float", "8bit", "4bit"])


@BITS
def test_a_decode_token_matches_the_loop(backend, bits: int) -> None:
    check_against_the_loop(backend, *routed(1), bits=bits)


@BITS
def test_many_tokens_over_several_tiles_an_expert_match_the_loop(backend, bits: int) -> None:
    # 40 tokens to 2 of 8 experts: 10 rows an expert on average, and experts 0 and 1 take
    # every token, so their rows span several 16-row tiles (the last one partial)
    choices = [[0, 1] if t % 2 else [1 + t % 7, 0] for t in range(40)]
    check_against_the_loop(backend, *routed(40, choices), bits=bits)


@BITS
def test_routing_that_leaves_experts_idle_matches_the_loop(backend, bits: int) -> None:
    choices = [[5, 2], [2, 5], [7, 2]]  # experts 0, 1, 3, 4 and 6 idle, 2 first and last
    check_against_the_loop(backend, *routed(3, choices), bits=bits)


def test_tiles_never_cross_an_expert() -> None:
    experts = torch.tensor([[3, 0]] * 5 + [[3, 1]] * 20)  # 0: 5 rows, 1: 20, 3: 25
    groups = group_by_expert(experts, 4, block_m=16)
    tiles = groups.block_expert >= 0
    assert groups.block_expert[tiles].tolist() == [0, 1, 1, 3, 3]
    assert groups.block_row[tiles].tolist() == [0, 5, 21, 25, 41]
    assert groups.row_ends.tolist() == [5, 25, 25, 50]
    assert len(groups.block_expert) >= 5 and not tiles[5:].any()


def test_the_experts_hold_views_into_the_stacks() -> None:
    moe = tiny_moe()
    before = [expert.down_proj.weight.clone() for expert in moe.experts]
    kernels = TritonExperts.of(moe)
    assert kernels is not None
    assert kernels.gate_up.weight.shape == (EXPERTS, 2 * WIDTH, HIDDEN)
    for i, expert in enumerate(moe.experts):
        assert expert.gate_up_proj.weight.data_ptr() == kernels.gate_up.weight[i].data_ptr()
        assert expert.down_proj.weight.data_ptr() == kernels.down.weight[i].data_ptr()
        assert torch.equal(expert.down_proj.weight, before[i])


def test_quantized_experts_hold_views_into_the_stacks() -> None:
    moe = tiny_moe(bits=4)
    kernels = TritonExperts.of(moe)
    assert kernels is not None and kernels.down.bits == 4
    for i, expert in enumerate(moe.experts):
        layer = expert.down_proj
        for name in ("qweight", "d", "m"):
            stack = getattr(kernels.down, "weight" if name == "qweight" else name)
            assert getattr(layer, name).data_ptr() == stack[i].data_ptr()


def test_experts_of_mixed_formats_stay_on_the_loop() -> None:
    moe, other = tiny_moe(bits=4), tiny_moe(bits=8)
    moe.experts[2].down_proj = other.experts[2].down_proj
    assert TritonExperts.of(moe) is None


def test_experts_with_a_bias_stay_on_the_loop() -> None:
    moe = tiny_moe()
    moe.experts[3].down_proj.bias = torch.nn.Parameter(torch.zeros(HIDDEN))
    assert TritonExperts.of(moe) is None
