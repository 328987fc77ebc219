"""MXFP4 (GGML type 39: gpt-oss's experts, llama-quantize's MXFP4_MOE) at the file's own precision.

Blocks packed into the CPU kernels' 4-bit MXFP4 form (e2m1 codes and an exponent byte per 32
inputs, cpp/kernels/qgemm.h) against gguf-py's own dequantization, bit for bit; into the 8-bit
tiles the Triton kernels read, exactly where fp16 holds the block's power of two; the matmul on
every instruction set this CPU runs against the float64 integer formula and against float32 math
on the dequantized weights; and files served end to end (a dense model, a mixture, gpt-oss, a
file written by llama.cpp's own llama-quantize) with the greedy tokens of the same model run in
float32 on the dequantized weights.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from test_kernels import assert_formula, random_input, reference_activations
from worker_testlib import load_runner, one_torch_thread  # noqa: F401 (an autouse fixture)

from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear
from pyserve.worker.backends.cpu.quant_linear import QuantEmbedding, QuantLinear
from pyserve.worker.model_runner import decode_weight_bytes

KERNELS = quant.kernels()
BLOCK_BYTES = 17  # an exponent byte, 16 bytes of codes


def mxfp4_blocks(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, k / 32 · 17]: a random weight as gguf-py quantizes it, with rows on different
    scales, an all-zero block and (past the first row) exponents at the edges ggml decodes:
    0 and 1 (subnormal scales) and fp16's range for the 8-bit form (103, 104, 136, 137)."""
    import gguf

    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 0.05, (rows, k)) * rng.uniform(0.1, 4, (rows, 1))
    weight[0, :32] = 0
    blocks = gguf.quants.quantize(weight.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    edges = [0, 1, 103, 104, 136, 137]
    for i, e in enumerate(edges[: (rows - 1) * (k // 32)]):
        row, block = 1 + i % (rows - 1), i // (rows - 1)
        blocks[row, block * BLOCK_BYTES] = e
    return blocks


def gguf_values(blocks: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)


def mxfp4_weight(n: int, k: int, seed: int = 0) -> quant.PackedWeight:
    return quant.pack_ggml_blocks([("MXFP4", mxfp4_blocks(n, k, seed))], n, k, 4)


# ---------------------------------------------------------------------------- packing


@pytest.mark.parametrize(("rows", "k"), [(40, 512), (16, 64), (3, 32), (33, 96)])
def test_mxfp4_in_its_own_form_is_gguf_pys_values_bit_for_bit(rows, k):
    """Codes and exponents kept as they are: every weight is what gguf-py's dequantize gives,
    subnormal scales (e < 2) and zero blocks too; the embedding rows as well; 4.25 bits a
    weight (16 bytes of codes and an exponent byte per 32)."""
    blocks = mxfp4_blocks(rows, k)
    packed = quant.pack_ggml_blocks([("MXFP4", blocks)], rows, k, 4)
    assert packed.mxfp4 and packed.bits == 4 and packed.precision == "mxfp4"
    exact = gguf_values(blocks)
    assert np.array_equal(quant.dequantize_weight(packed).numpy(), exact)
    picked = torch.tensor([0, rows - 1, rows // 2, 1])
    assert np.array_equal(quant.packed_rows(packed, picked).numpy(), exact[picked.numpy()])
    assert packed.nbytes * 8 / (-(-rows // 16) * 16 * k) == 4.25
    u, _, _ = quant.unpack_weight(packed)
    assert int(u.max()) <= 2 * quant.MXFP4_OFFSET


def test_mxfp4_parts_pack_one_after_another():
    """A projection made of several MXFP4 tensors (gate and up): one weight, every row exact."""
    gate, up = mxfp4_blocks(32, 128, seed=1), mxfp4_blocks(20, 128, seed=2)
    packed = quant.pack_ggml_blocks([("MXFP4", gate), ("MXFP4", up)], 52, 128, 4)
    want = np.concatenate([gguf_values(gate), gguf_values(up)])
    assert np.array_equal(quant.dequantize_weight(packed).numpy(), want)


def test_mxfp4_in_8_bit_tiles_is_exact_where_fp16_holds_the_scale():
    """The Triton kernels' form: u = 2·e2m1 + 128, d = 2^(e − 128), m = −128·d per 32, exactly
    the file's where fp16 holds d and m (e in [104, 136]); a block beyond is rounded as
    quantize_weight rounds its values (within half an int8 step of the block's largest / 127)."""
    rows, k = 40, 256
    blocks = mxfp4_blocks(rows, k)
    packed = quant.pack_ggml_blocks([("MXFP4", blocks)], rows, k, 8)
    assert not packed.mxfp4 and packed.bits == 8
    got = quant.dequantize_weight(packed).numpy().reshape(rows, -1, 32)
    exact = gguf_values(blocks)
    rounded = quant.dequantize_weight(quant.quantize_weight(torch.from_numpy(exact), 8))
    rounded, exact = rounded.numpy().reshape(rows, -1, 32), exact.reshape(rows, -1, 32)
    e = blocks.reshape(rows, -1, BLOCK_BYTES)[..., 0]
    inside = (e >= 104) & (e <= 136)
    assert (~inside).sum() == 5  # the edges 0, 1, 103, 137 and the zero block (e = 0)
    assert np.array_equal(got[inside], exact[inside])
    assert np.array_equal(got[~inside], rounded[~inside])


def test_mxfp4_blocks_pack_only_into_their_own_forms():
    blocks = mxfp4_blocks(16, 64)
    with pytest.raises(ValueError, match="own exponents"):
        quant.pack_ggml_blocks([("MXFP4", blocks)], 16, 64, 4, super_scales=True)
    import gguf

    q4_0 = gguf.quants.quantize(np.zeros((16, 64), np.float32), gguf.GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="all parts MXFP4"):
        quant.pack_ggml_blocks([("MXFP4", blocks), ("Q4_0", q4_0)], 32, 64, 4)
    with pytest.raises(ValueError, match="all parts MXFP4"):
        quant.pack_ggml_blocks([("Q4_0", q4_0), ("MXFP4", blocks)], 32, 64, 4)
    with pytest.raises(ValueError, match="do not pack"):
        quant.pack_ggml_blocks([("MXFP4", blocks)], 16, 64, 5)
    assert "MXFP4" in KERNELS.GGML_PACKED_TYPES


# ---------------------------------------------------------------------------- the kernels

# (rows, n, k): one decode row, many prefill rows, partial tiles, k a multiple of 32 only
# (gpt-oss's 2880 is 90 blocks), rows past the 4/8/16-row blocks and 8-row panels
SHAPES = [
    (1, 1, 32), (1, 37, 96), (2, 17, 64), (5, 100, 256), (8, 33, 160), (13, 50, 96),
    (19, 21, 224), (40, 33, 128), (3, 300, 1024),
]  # fmt: skip


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_mxfp4_matmul_is_the_integer_formula(isa, activation_bits):
    """Σ_g s·2^(e − 128)·Σ value·q (written as d·Σu·q + m·Σq with u = value + 12, m = −12·d)
    in float64, within float32 rounding, on every ISA, with a bias on every other shape."""
    for i, (rows, n, k) in enumerate(SHAPES):
        packed = mxfp4_weight(n, k, seed=i)
        x = random_input(rows, k, seed=i)
        bias = torch.randn(n) if i % 2 else None
        assert_formula(x, packed, activation_bits, bias, (rows, n, k))


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_mxfp4_matmul_is_float32_math_on_the_dequantized_weights(isa, activation_bits):
    """The weights are the file's exactly, so against x @ wᵀ in float32 on the dequantized
    weights the only difference is the activations' rounding, |x − x̂| @ |w|ᵀ, and float32's."""
    for i, (rows, n, k) in enumerate(SHAPES):
        packed = mxfp4_weight(n, k, seed=i)
        w = quant.dequantize_weight(packed)
        x = random_input(rows, k, seed=i)
        q, scale = reference_activations(x, quant.GROUP, activation_bits)
        x_hat = (q.view(rows, -1, quant.GROUP) * scale[..., None]).view(rows, -1)[:, :k]
        bound = (x - x_hat).abs() @ w.abs().T
        got = quant_linear.quantized_matmul(x, packed, activation_bits=activation_bits)
        slack = 1e-5 * (x.abs() @ w.abs().T) + 1e-6
        assert ((got - x @ w.T).abs() <= bound + slack).all(), (rows, n, k)


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_the_largest_mxfp4_sum_shifted_by_the_headroom_stays_in_int32(isa, activation_bits):
    """Every code ±12 (the largest magnitude) against every |q| at its top in group 0 and a
    tiny group 1: group 0's Σ value·q is shifted by the whole headroom."""
    top = 127 if activation_bits == 8 else 32767
    blocks = np.zeros((16, 2 * BLOCK_BYTES), dtype=np.uint8)
    blocks[:, [0, BLOCK_BYTES]] = 128  # 2^0
    blocks[:8, 1:BLOCK_BYTES] = 0x77  # code 7: +12
    blocks[8:, 1:BLOCK_BYTES] = 0xFF  # code 15: −12
    packed = quant.pack_ggml_blocks([("MXFP4", blocks)], 16, 64, 4)
    x = torch.full((1, 64), 1e-6)
    x[0, :32] = top * 2.0**-15
    got = assert_formula(x, packed, activation_bits)
    assert (got[0, :8] > 0).all() and (got[0, 8:] < 0).all()


def test_the_isas_agree_bit_for_bit_on_mxfp4():
    """Each group's product is exact and every ISA adds them in the same order."""
    packed = mxfp4_weight(200, 320, seed=7)
    isas = KERNELS.supported_isas()
    for rows in (1, 6, 19):
        x = random_input(rows, 320, seed=rows)
        for bits in (8, 16):
            results = []
            for name in isas:
                KERNELS.set_isa(name)
                results.append(quant_linear.quantized_matmul(x, packed, activation_bits=bits))
            KERNELS.set_isa(isas[0])
            for other in results[1:]:
                assert torch.equal(other, results[0]), (rows, bits)


def test_mxfp4_flag_needs_4_bit_groups_of_32():
    w = quant.quantize_weight(torch.randn(16, 64), 8)
    x, out = torch.randn(1, 64), torch.empty(1, 16)
    with pytest.raises(ValueError, match="MXFP4 weights are 4-bit codes in groups of 32"):
        KERNELS.matmul(x.data_ptr(), 64, 1, 16, w.data.data_ptr(), w.scales.data_ptr(), 16, 64,
                       8, 32, 0, out.data_ptr(), 16, False, True)  # fmt: skip


def test_a_segmented_projection_keeps_its_mxfp4_part():
    """gate MXFP4 beside an up at another precision: each segment on its own kernel, the MXFP4
    rows exactly as their own layer computes them."""
    mx = mxfp4_weight(32, 128, seed=4)
    other = quant.quantize_weight(torch.randn(16, 128) * 0.05, 8)
    fused = QuantLinear.from_packed(quant.SegmentedWeight((mx, other)), None)
    x = torch.randn(3, 128)
    alone = torch.cat([QuantLinear.from_packed(p, None)(x) for p in (mx, other)], dim=1)
    assert torch.equal(fused(x), alone)


# ---------------------------------------------------------------------------- served end to end

DENSE = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip
PROMPTS = [[1, 5, 9, 200, 17, 3], list(range(30, 70)), [7] * 12]


def greedy(runner, prompts=PROMPTS, tokens: int = 16) -> list[list[int]]:
    from pyserve.wire.main_to_worker import SamplingParams
    from pyserve.worker.offline import OfflineEngine

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine = OfflineEngine(
        runner=runner, num_blocks=runner.num_blocks, block_size=runner.block_size
    )
    outputs = engine.generate(prompts, params)
    return [list(o.token_ids) for o in outputs]


def serve(path: Path, **settings):
    return load_runner(str(path), num_blocks=64, block_size=4, **settings)


def float_reference(path: Path):
    """The same file in float32 on the dequantized weights (gguf-py's values)."""
    return serve(path, quantization="none", dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def dense_mxfp4(tmp_path_factory):
    """A tiny Llama whose every matrix is MXFP4 (embedding and output too)."""
    import gguf
    from test_model_loading import tiny_llama

    path = tmp_path_factory.mktemp("mxfp4") / "dense-mxfp4.gguf"
    stored = write_gguf(tiny_llama(**DENSE), path, matrix_type=gguf.GGMLQuantizationType.MXFP4)
    return path, {name: torch.from_numpy(array) for name, array in stored.items()}


@pytest.mark.parametrize("backend", ["cpu-kernels", "torch"])
def test_a_dense_mxfp4_file_is_served_at_its_own_precision(dense_mxfp4, backend):
    """Every projection on the MXFP4 kernels (the output projection in exact 8-bit tiles), the
    embedding packed, every weight the file's, 4.25 bits a weight read per decode step, and the
    greedy tokens of the float32 model on the dequantized weights."""
    path, stored = dense_mxfp4
    runner = serve(path, quantization="auto", backend=backend, kv_cache_dtype="float32")
    assert runner.packed_precisions == {"int8": 1, "mxfp4": 4 * DENSE["num_hidden_layers"]}
    model = runner.model
    gate_up = model.layers[1].gate_up_proj
    assert isinstance(gate_up, QuantLinear) and gate_up.packed.mxfp4
    want = torch.cat([stored[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(quant.dequantize_weight(gate_up.packed), want)
    down = model.layers[0].down_proj
    assert torch.equal(
        quant.dequantize_weight(down.packed), stored["model.layers.0.mlp.down_proj.weight"]
    )
    assert decode_weight_bytes(down) * 8 == 4.25 * down.packed.n * down.packed.k
    head = model.lm_head
    assert head.packed.bits == 8 and torch.equal(
        quant.dequantize_weight(head.packed), stored["lm_head.weight"]
    )
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.packed.mxfp4
    if backend == "cpu-kernels":  # the C++ decoder stack takes the MXFP4 projections too
        assert runner.backend.info().kernels["decoder_stack"].startswith("on"), (
            runner.backend.info().kernels
        )
    assert greedy(runner) == greedy(float_reference(path))


def test_a_dense_mxfp4_file_with_int8_activations(dense_mxfp4):
    """--activation-bits 8: the MXFP4 loops' int8 path, llama.cpp's rounding of the inputs."""
    from test_model_loading import prefill_logits

    path, _ = dense_mxfp4
    runner = serve(path, quantization="auto", activation_bits=8, kv_cache_dtype="float32")
    assert runner.model.layers[0].qkv_proj.activation_bits == 8
    ours = prefill_logits(runner).log_softmax(-1)
    exact = prefill_logits(float_reference(path)).log_softmax(-1)
    # int8's rounding, as llama.cpp's: logprobs move by ~0.01 on average (the integer formula
    # above holds these loops to the bit)
    assert (ours - exact).abs().mean() < 0.02 and (ours - exact).abs().max() < 0.15


def test_a_dense_mxfp4_file_on_the_triton_backend(dense_mxfp4, caplog, monkeypatch):
    """The Triton kernels have no MXFP4 loop: the tensors go to their 8-bit tiles, every weight
    exact (the random weights' scales are well inside fp16), said once in the log."""
    from test_model_loading import prefill_logits

    from pyserve.worker import weight_packing
    from pyserve.worker.backends.triton.quant_matmul import TritonQuantLinear

    monkeypatch.setattr(weight_packing, "_mxfp4_noted", False)  # said once a process
    path, stored = dense_mxfp4
    with caplog.at_level(logging.INFO, logger="pyserve.worker.weight_packing"):
        runner = serve(
            path, quantization="auto", backend="triton", dtype="float32", kv_cache_dtype="float32"
        )
    assert "MXFP4 tensors" in caplog.text and "8-bit" in caplog.text
    assert runner.packed_precisions == {"int8": 4 * DENSE["num_hidden_layers"] + 1}
    down = runner.model.layers[1].down_proj
    assert isinstance(down, TritonQuantLinear) and down.bits == 8
    # the Triton layout: [inputs, outputs]
    w = down.qweight.float().cpu() * down.d.float().cpu().repeat_interleave(32, 0)
    w += down.m.float().cpu().repeat_interleave(32, 0)
    assert torch.equal(w.t(), stored["model.layers.1.mlp.down_proj.weight"])
    ours = prefill_logits(runner).log_softmax(-1)
    exact = prefill_logits(float_reference(path)).log_softmax(-1)
    assert (ours - exact).abs().max() < 1e-4


MOE = {
    "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "hidden_size": 64, "vocab_size": 512,
}  # fmt: skip


def test_a_mixture_with_mxfp4_experts(tmp_path):
    """A Qwen3-MoE GGUF, every matrix MXFP4 (the stacked experts sliced per expert): each expert
    packed in MXFP4's form from its slice, the layers' experts as grouped matmuls, and the greedy
    tokens of the float32 model on the dequantized weights."""
    import gguf
    from hf_parity import make_tiny_model

    model = make_tiny_model(tmp_path / "hf", "qwen3_moe", seed=3, **MOE)
    path = tmp_path / "moe-mxfp4.gguf"
    stored = write_gguf(model, path, matrix_type=gguf.GGMLQuantizationType.MXFP4)
    runner = serve(path, quantization="auto", kv_cache_dtype="float32")
    info = runner.backend.info()
    if info.name == "cpu-kernels":
        assert info.kernels["experts"] == "grouped on 3 of 3 layers", info.kernels
    experts = runner.model.layers[2].moe.experts
    assert all(e.gate_up_proj.packed.mxfp4 and e.down_proj.packed.mxfp4 for e in experts)
    want = torch.from_numpy(stored["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert torch.equal(quant.dequantize_weight(experts[5].down_proj.packed), want)
    assert greedy(runner) == greedy(float_reference(path))


def test_gpt_oss_with_mxfp4_experts(tmp_path):
    """gpt-oss as llama.cpp's converter writes it, its matrices MXFP4: biases beside the MXFP4
    projections, experts with biases (the loop over each expert's layer), sinks."""
    import gguf
    from hf_parity import make_tiny_model
    from test_model_families import MOE_FAMILIES

    kind, overrides = MOE_FAMILIES["gpt-oss-window"]
    model = make_tiny_model(tmp_path / "hf", kind, seed=1, **overrides)
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    write_gguf(model, path, matrix_type=gguf.GGMLQuantizationType.MXFP4)
    runner = serve(path, quantization="auto", kv_cache_dtype="float32")
    expert = runner.model.layers[0].moe.experts[3]
    assert expert.gate_up_proj.packed.mxfp4 and expert.gate_up_proj.bias is not None
    assert set(runner.packed_precisions) == {"mxfp4", "int8"}
    assert greedy(runner) == greedy(float_reference(path))


def llama_quantize() -> Path | None:
    from pyserve.model_files import cache_dir

    binary = cache_dir() / "peers" / "llama.cpp-build" / "bin" / "llama-quantize"
    return binary if binary.is_file() else None


@pytest.mark.skipif(
    llama_quantize() is None,
    reason="no llama-quantize binary on this machine (benchmarks/compare.py builds it from the "
    "llama-cpp-python sdist); MXFP4 files written with gguf-py's quantizer are tested regardless",
)
def test_a_file_from_llama_quantize_mxfp4_moe(tmp_path):
    """llama.cpp's own writer: a tiny Qwen3-MoE F32 GGUF through `llama-quantize ... MXFP4_MOE`
    (the stacked experts MXFP4, the other matrices Q8_0): served with the experts in MXFP4's
    form and the rest in 8-bit tiles, every weight the file's, the greedy tokens of the float32
    model on the dequantized weights."""
    import gguf
    from hf_parity import make_tiny_model

    model = make_tiny_model(tmp_path / "hf", "qwen3_moe", seed=3, **MOE)
    source, path = tmp_path / "moe-f32.gguf", tmp_path / "moe-mxfp4-moe.gguf"
    write_gguf(model, source)
    done = subprocess.run(
        [str(llama_quantize()), str(source), str(path), "MXFP4_MOE"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "MXFP4", types
    assert types["blk.0.attn_q.weight"] == "Q8_0", types
    runner = serve(path, quantization="auto", kv_cache_dtype="float32")
    assert (
        runner.packed_precisions.get("mxfp4")
        and runner.model.layers[1].moe.experts[0].down_proj.packed.mxfp4
    )
    exact = float_reference(path)
    got = quant.dequantize_weight(runner.model.layers[1].moe.experts[6].gate_up_proj.packed)
    assert torch.equal(got, exact.model.layers[1].moe.experts[6].gate_up_proj.weight)
    assert greedy(runner) == greedy(exact)


def test_an_mxfp4_mixture_loads_in_about_its_size(tmp_path):
    """A ~40 MB file (a Qwen3-MoE whose matrices, stacked experts included, are MXFP4) loads in
    about its size: each expert packed from its slice of the file's blocks; a float32 copy of
    the experts (~300 MB) would fail the bound."""
    import gguf
    import transformers
    from test_gguf_packing import assert_loads_in_about_its_size, loading_peak

    config = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=1024, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=1024, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    path = tmp_path / "moe-mxfp4.gguf"
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    write_gguf(model, path, matrix_type=mxfp4, random_types=("MXFP4",))
    del model
    got = loading_peak(str(path))
    assert got["precisions"] == {"int8": 1, "mxfp4": 3 * (2 + 2 * 8)}, got
    assert_loads_in_about_its_size(got, path.stat().st_size)
