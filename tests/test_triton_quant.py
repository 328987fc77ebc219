"""8- and 4-bit weights on the Triton kernels (the GPU's quantized layers), in Triton's
interpreter: the matmul against the dequantized weights in float64, split-K included, and a
GGUF of exactly representable block types served through the Triton backend against
transformers' logits of the same file (float32). bf16 is not checked here: the interpreter's
``tl.dot`` multiplies bf16 bit patterns (triton-lang/triton#11584); tests/test_triton_compile.py
compiles the kernel for GPUs in bf16, fp16 and float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf_files import write_gguf
from test_model_loading import hf_logits, prefill_logits, runner, tiny_llama
from worker_testlib import one_torch_thread  # noqa: F401 (an autouse fixture)

from pyserve.worker.backends.cpu.quant_linear import QuantEmbedding, QuantLinear
from pyserve.worker.backends.triton.quant_matmul import (
    TritonQuantLinear,
    device_layout,
    quant_matmul,
)
from pyserve.worker.quant import dequantize_weight, quantize_weight

torch.manual_seed(0)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 70, 96), (5, 64, 64), (40, 33, 100), (70, 130, 64)],  # k past a group, rows past 64
)
def test_the_layer_is_x_times_the_dequantized_weight(bits: int, rows: int, n: int, k: int):
    weight, bias = torch.randn(n, k), torch.randn(n)
    packed = quantize_weight(weight, bits)
    x = torch.randn(rows, k)
    want = F.linear(x.double(), dequantize_weight(packed).double(), bias.double())
    got = TritonQuantLinear(packed, bias, dtype=torch.float32, device="cpu")(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    no_bias = TritonQuantLinear(packed, None, dtype=torch.float32, device="cpu")(x[None])
    assert no_bias.shape == (1, rows, n)
    torch.testing.assert_close(no_bias[0].double(), want - bias.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
# loop steps of 4 groups: 7 groups end in a partial step; 16 in 4 steps, split 3 or 4 ways
@pytest.mark.parametrize(("groups", "split"), [(7, 2), (16, 3), (16, 4), (16, 9)])
def test_split_k_adds_the_same_sums(bits: int, groups: int, split: int):
    weight, bias = torch.randn(48, groups * 32), torch.randn(48)
    packed = quantize_weight(weight, bits)
    u, d, m = device_layout(packed)
    x = torch.randn(3, groups * 32)
    want = F.linear(x.double(), dequantize_weight(packed).double(), bias.double())
    got = quant_matmul(x, u, d, m, bits=bits, group=32, n=48, bias=bias, split=split)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_device_layout_holds_the_packed_integers(bits: int):
    packed = quantize_weight(torch.randn(20, 64), bits)
    u, d, m = device_layout(packed)
    # outputs contiguous: [inputs, outputs]
    assert u.dtype == torch.uint8 and u.shape == (64 * bits // 8, 20) and u.is_contiguous()
    assert d.shape == m.shape == (2, 20) and d.dtype == torch.float16 and d.is_contiguous()
    if bits == 4:  # input 2j in the low nibble of byte row j, 2j+1 in the high one
        u = torch.stack([u & 0x0F, u >> 4], dim=1).view(64, 20)
    w = d.float().repeat_interleave(32, 0) * u.float() + m.float().repeat_interleave(32, 0)
    assert torch.equal(w.t(), dequantize_weight(packed))


def test_no_rows_give_an_empty_output():
    layer = TritonQuantLinear(
        quantize_weight(torch.randn(16, 32), 8), None, dtype=torch.float32, device="cpu"
    )
    assert layer(torch.empty(0, 32)).shape == (0, 16)


# ---------------------------------------------------------------------------- a served file

EXACT = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
# block types that pack bit for bit (the effective weights are the file's exactly), 4- and 8-bit
TYPES = {
    "model.embed_tokens.weight": "Q8_0",
    "lm_head.weight": "Q8_0",
    "model.layers.0.self_attn.q_proj.weight": "Q4_0",
    "model.layers.0.self_attn.k_proj.weight": "Q4_0",
    "model.layers.0.self_attn.v_proj.weight": "Q4_1",
    "model.layers.0.self_attn.o_proj.weight": "Q4_1",
    "model.layers.0.mlp.gate_proj.weight": "Q4_1",
    "model.layers.0.mlp.up_proj.weight": "Q4_0",
    "model.layers.0.mlp.down_proj.weight": "Q4_1",
    "model.layers.1.self_attn.q_proj.weight": "Q8_0",
    "model.layers.1.self_attn.k_proj.weight": "Q5_0",
    "model.layers.1.self_attn.v_proj.weight": "Q5_1",
    "model.layers.1.self_attn.o_proj.weight": "Q8_0",
    "model.layers.1.mlp.gate_proj.weight": "Q8_0",
    "model.layers.1.mlp.up_proj.weight": "Q5_0",
    "model.layers.1.mlp.down_proj.weight": "Q5_1",
}


@pytest.fixture(scope="module")
def exact_gguf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("exact") / "exact.gguf"
    write_gguf(tiny_llama(**EXACT), path, tensor_types=TYPES)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return path, hf.eval()


def test_a_quantized_file_on_the_triton_backend_gives_transformers_logits(exact_gguf):
    path, hf = exact_gguf
    loaded = runner(
        path, quantization="auto", backend="triton", dtype="float32", kv_cache_dtype="float32"
    )
    assert loaded.packed_precisions == {"int4": 4, "int8": 5}  # layer 0, then layer 1 + head
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, TritonQuantLinear)]
    assert len(layers) == 9 and not any(isinstance(m, QuantLinear) for m in model.modules())
    assert model.layers[0].gate_up_proj.bits == 4 and model.layers[1].qkv_proj.bits == 8
    # /server_info says what computes the projections
    assert loaded.backend.info().kernels["linear"] == "triton 8-/4-bit on 9 layers, else torch"
    # the untied embedding is a plain table on the device: a gather, not a CPU unpack
    assert isinstance(model.embed_tokens, torch.Tensor)
    assert not isinstance(model.embed_tokens, QuantEmbedding)
    ours = prefill_logits(loaded).log_softmax(-1)
    theirs = hf_logits(hf).log_softmax(-1)
    assert (ours - theirs).abs().max() < 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
