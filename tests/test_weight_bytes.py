"""The bytes of weights a decode step reads (ModelRunner.weight_bytes, reported in WorkerReady and
/server_info): the weights in the form the forward reads them, embeddings aside."""

from __future__ import annotations

import pytest
import torch
from worker_testlib import load_runner, make_tiny_llama

from pyserve.worker.model_runner import decode_weight_bytes


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_float_weights_count_every_parameter_but_the_token_embeddings(tiny_dir):
    runner = load_runner(str(tiny_dir), num_blocks=8, block_size=16, dtype="float32")
    model = runner.model
    unique = {p.data_ptr(): p.nbytes for p in model.parameters()}
    embedding = model.embed_tokens
    head = model.lm_head.weight
    tied = head is not None and head.data_ptr() == embedding.data_ptr()
    want = sum(unique.values()) - (0 if tied else embedding.nbytes)
    assert runner.weight_bytes == decode_weight_bytes(model) == want


def test_quantized_weights_count_their_packed_form(tiny_dir):
    runner = load_runner(
        str(tiny_dir), num_blocks=8, block_size=16, dtype="float32", quantization="int4"
    )
    packed = {
        m.packed.data.data_ptr(): m.packed.nbytes
        for m in runner.model.modules()
        if hasattr(getattr(m, "packed", None), "scales") and "Embedding" not in type(m).__name__
    }
    norms = sum(
        p.nbytes
        for m in runner.model.modules()
        if "Norm" in type(m).__name__
        for p in m.parameters(recurse=False)
    )
    assert packed, "no packed projections"
    assert runner.weight_bytes == sum(packed.values()) + norms
    floats = load_runner(str(tiny_dir), num_blocks=8, block_size=16, dtype="float32")
    assert runner.weight_bytes < floats.weight_bytes / 4  # ~5 bits a weight against 32


def test_a_module_counts_each_storage_once():
    lin = torch.nn.Linear(8, 4)
    model = torch.nn.Sequential(lin, lin)
    assert decode_weight_bytes(model) == lin.weight.nbytes + lin.bias.nbytes


def test_a_mixtures_experts_count_by_the_share_a_token_runs():
    from pyserve.worker.models.config import MoEConfig
    from pyserve.worker.models.moe import SparseMoE

    moe = SparseMoE(16, MoEConfig(8, 2, 4, True), dtype=torch.float32, device="cpu")
    model = torch.nn.ModuleList([moe])
    expert = sum(p.nbytes for p in moe.experts[0].parameters())
    assert decode_weight_bytes(model) == moe.router.nbytes + 2 * expert  # 2 of 8 experts
