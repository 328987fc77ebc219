"""Mixtures of experts (pyserve/worker/models/moe.py) beyond the families' HF parity
(test_model_families.py): the routing against transformers' own sparse blocks where it is
fragile (ties, every token on one expert, experts no token picks), a decode token running
only its k experts, a quantized GGUF's stacked experts packed at the file's precision, and
``--tp 2`` (each expert split across the ranks) equal to one process in float32."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from hf_parity import make_tiny_model
from llama_cpp_source import required_converter
from worker_testlib import load_runner, one_torch_thread  # noqa: F401 (an autouse fixture)

from pyserve.worker import quant
from pyserve.worker.models.config import MoEConfig
from pyserve.worker.models.moe import SparseMoE

HIDDEN, EXPERTS, WIDTH, SHARED = 32, 8, 16, 24
HANG_GUARD_S = 120.0  # only against a hang


def _backend():
    from pyserve.worker.backends import attention_backend

    return attention_backend(
        "torch", heads=2, kv_heads=2, dim=16, num_layers=1, num_blocks=4, block_size=4,
        dtype=torch.float32,
    )  # fmt: skip


def _hf_block(kind: str, top_k: int):
    """transformers' sparse block of ``kind`` with random weights, and its config."""
    import transformers

    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=top_k,
            moe_intermediate_size=WIDTH, shared_expert_intermediate_size=SHARED,
        )  # fmt: skip
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        block = Qwen2MoeSparseMoeBlock(config)
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(
            hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=top_k,
            intermediate_size=WIDTH,
        )  # fmt: skip
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        block = GptOssMLP(config)
    else:
        config = transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=top_k,
            moe_intermediate_size=WIDTH, norm_topk_prob=True,
        )  # fmt: skip
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
    return block.float().eval(), config


def _router(block) -> torch.nn.Module:
    return block.router if hasattr(block, "router") else block.gate


def _ours(block, kind: str, top_k: int) -> SparseMoE:
    """A SparseMoE holding the HF block's weights (its experts are stacked [E, 2·width, hidden]
    gate-then-up and [E, hidden, width] tensors)."""
    shared = SHARED if kind == "qwen2_moe" else 0
    gpt_oss = kind == "gpt_oss"
    moe = MoEConfig(
        EXPERTS, top_k, WIDTH, kind != "qwen2_moe", shared_expert_size=shared,
        router_bias=gpt_oss, expert_bias=gpt_oss, softmax_after_top_k=gpt_oss,
    )  # fmt: skip
    ours = SparseMoE(HIDDEN, moe, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        ours.router.copy_(_router(block).weight)
        experts = block.experts
        for e, expert in enumerate(ours.experts):
            if gpt_oss:  # [in, out], gate and up outputs alternating, with biases
                gate_up = experts.gate_up_proj[e].T
                expert.gate_up_proj.weight.copy_(torch.cat([gate_up[::2], gate_up[1::2]]))
                bias = experts.gate_up_proj_bias[e]
                expert.gate_up_proj.bias.copy_(torch.cat([bias[::2], bias[1::2]]))
                expert.down_proj.weight.copy_(experts.down_proj[e].T)
                expert.down_proj.bias.copy_(experts.down_proj_bias[e])
            else:
                expert.gate_up_proj.weight.copy_(experts.gate_up_proj[e])
                expert.down_proj.weight.copy_(experts.down_proj[e])
        if gpt_oss:
            ours.router_bias.copy_(block.router.bias)
        if shared:
            mlp = block.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            )
            ours.shared_expert.down_proj.weight.copy_(mlp.down_proj.weight)
            ours.shared_gate.copy_(block.shared_expert_gate.weight)
    return ours


def _experts_run(
    moe: SparseMoE, x: torch.Tensor, activation: str = "silu"
) -> tuple[torch.Tensor, list[int]]:
    """The block's output and how many rows each expert computed."""
    rows = [0] * len(moe.experts)
    hooks = [
        expert.register_forward_hook(lambda m, a, out, e=e: rows.__setitem__(e, a[0].shape[0]))
        for e, expert in enumerate(moe.experts)
    ]
    try:
        out = moe(x, _backend(), activation)
    finally:
        for hook in hooks:
            hook.remove()
    return out, rows


ROUTERS = ["random", "ties", "one-expert-for-all"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("router", ROUTERS)
def test_routing_matches_transformers_sparse_block(kind, router):
    """Ties (a zero router: every probability equal, torch.topk's choice), every token on one
    expert and experts no token picks: the same output as transformers' block, and an expert
    runs once over exactly the tokens that picked it."""
    top_k = 2
    block, _ = _hf_block(kind, top_k)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    gate = _router(block)
    with torch.no_grad():
        if router == "ties":
            gate.weight.zero_()
            if kind == "gpt_oss":
                gate.bias.zero_()
        elif router == "one-expert-for-all":
            x = x.abs()  # positive inputs: expert 0's all-positive row wins every token
            gate.weight.fill_(-0.1)
            gate.weight[0] = 1.0
    ours = _ours(block, kind, top_k)
    with torch.no_grad():
        want = block(x[None])[0]
        if kind == "gpt_oss":
            want = want[0]  # (output, router scores)
        got, rows = _experts_run(ours, x, "clamped_swiglu" if kind == "gpt_oss" else "silu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, picked = ours.route(x)
    assert rows == torch.bincount(picked.reshape(-1), minlength=EXPERTS).tolist()
    assert sum(rows) == len(x) * top_k
    if router == "ties":  # equal probabilities: every token picks the same k experts
        assert sorted(rows, reverse=True)[: top_k + 1] == [len(x)] * top_k + [0]
    if router == "one-expert-for-all":
        assert rows[0] == len(x)
    if router != "random":
        assert rows.count(0) >= EXPERTS - top_k  # the idle experts never ran


def test_a_decode_token_runs_only_its_experts():
    block, _ = _hf_block("qwen3_moe", 2)
    ours = _ours(block, "qwen3_moe", 2)
    with torch.no_grad():
        _, rows = _experts_run(ours, torch.randn(1, HIDDEN))
    assert sorted(rows, reverse=True)[:3] == [1, 1, 0] and sum(rows) == 2


# ---------------------------------------------------------------------- a quantized GGUF

QWEN3_MOE = {
    "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "hidden_size": 64, "vocab_size": 512,
}  # fmt: skip


def test_stacked_q8_0_experts_are_packed_as_the_file_holds_them(tmp_path):
    """A Qwen3-MoE GGUF whose matrices (the stacked experts included) are Q8_0: every expert is
    packed at 8 bits from its own slice of the stacked tensor, and the logits stay within the
    activations' rounding of the file's exact weights run in float32."""
    import gguf

    model = make_tiny_model(tmp_path / "hf", "qwen3_moe", seed=3, **QWEN3_MOE)
    path = tmp_path / "moe-q8.gguf"
    stored = write_gguf(model, path, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    exact = load_runner(
        str(path), num_blocks=64, block_size=4, quantization="none", kv_cache_dtype="float32"
    )
    packed = load_runner(str(path), num_blocks=64, block_size=4, quantization="auto")
    assert set(packed.packed_precisions) == {"int8"}
    info = packed.backend.info()
    if info.name == "cpu-kernels":  # each layer's router and grouped experts on the kernels
        assert info.kernels["experts"] == "grouped on 3 of 3 layers", info.kernels
        assert info.kernels["moe_router"] == "kernels on 3 of 3 layers", info.kernels
        if packed.decoder_stack is not None:  # every layer in one call (test_cpu_decoder.py)
            assert info.kernels["decoder_stack"] == "on", info.kernels
        else:  # the layer loop
            assert info.kernels["torch_threads"].startswith("1 ")  # beside the kernels' pool
    layer = packed.model.layers[0].moe
    assert type(layer.experts[5].gate_up_proj).__name__ != "Linear"  # packed, not float
    reference = exact.model.layers[1].moe.experts[3].down_proj.weight
    want = torch.from_numpy(stored["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert torch.equal(reference, want)  # expert 3's slice of the stacked tensor, as written
    prompt = list(range(5, 45))
    ours, ref = (_prefill_logprobs(r, prompt) for r in (packed, exact))
    assert (ours - ref).abs().max() < 0.02


GPT_OSS = {
    "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
    "hidden_size": 64, "vocab_size": 512, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}  # fmt: skip


def test_a_q8_0_gpt_oss_gguf_runs_its_biased_experts_grouped(tmp_path):
    """gpt-oss as a Q8_0 GGUF: the stacked experts packed at 8 bits with their stacked biases,
    every layer's experts grouped on the CPU kernels, attention (sinks, windows) on the
    kernels, the whole model on the decoder stack where it runs (AVX-512 VNNI), and the logits
    within the activations' rounding of the file's exact weights."""
    import gguf

    model = make_tiny_model(tmp_path / "hf", "gpt_oss", seed=3, **GPT_OSS)
    path = tmp_path / "gpt-oss-q8.gguf"
    write_gguf(model, path, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    exact = load_runner(
        str(path), num_blocks=64, block_size=4, quantization="none", kv_cache_dtype="float32"
    )
    packed = load_runner(str(path), num_blocks=64, block_size=4, quantization="auto")
    assert set(packed.packed_precisions) == {"int8"}
    info = packed.backend.info()
    if info.name == "cpu-kernels":
        assert info.kernels["experts"] == "grouped on 3 of 3 layers", info.kernels
        assert info.kernels["attention"] == "kernels", info.kernels
        if info.kernels["isa"] == "avx512_vnni":
            assert info.kernels["decoder_stack"] == "on", info.kernels
    expert = packed.model.layers[2].moe.experts[6]
    assert type(expert.down_proj).__name__ != "Linear" and expert.down_proj.bias is not None
    prompt = list(range(5, 45))
    ours, ref = (_prefill_logprobs(r, prompt) for r in (packed, exact))
    assert (ours - ref).abs().max() < 0.02


def _as_published_mxfp4(directory) -> None:
    """The gpt-oss checkpoint in ``directory`` rewritten as OpenAI publishes gpt-oss: every
    expert tensor as MXFP4 codes ``*_blocks`` [experts, outputs, groups, 16] (the even element
    in the low nibble) and exponents ``*_scales``, quantized by gguf-py, with the
    quantization_config that tells transformers so."""
    import gguf
    from safetensors.torch import load_file, save_file

    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    path = directory / "model.safetensors"
    state = load_file(path)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(name).transpose(1, 2)  # [experts, out, in]
        experts, n, k = weight.shape
        blocks = gguf.quants.quantize(weight.reshape(experts * n, k).numpy(), mxfp4)
        blocks = blocks.reshape(experts, n, k // 32, 17)
        codes = np.empty((experts, n, k // 32, 32), np.uint8)
        codes[..., :16], codes[..., 16:] = blocks[..., 1:] & 15, blocks[..., 1:] >> 4
        state[name + "_blocks"] = torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4))
        state[name + "_scales"] = torch.from_numpy(blocks[..., 0].copy())
    save_file(state, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))


def test_gpt_oss_as_published_with_mxfp4_experts_matches_transformers(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales (as openai/gpt-oss-20b
    ships): read as GGML's MXFP4 rows, the same model transformers dequantizes from the same
    file: its greedy tokens and logprobs."""
    from hf_parity import BLOCK_SIZE, Driver, assert_all_match, hf_greedy, make_prompts
    from transformers import AutoModelForCausalLM, Mxfp4Config

    directory = tmp_path / "hf"
    make_tiny_model(directory, "gpt_oss", seed=3, **GPT_OSS)
    _as_published_mxfp4(directory)
    # dequantized by transformers itself, never through its hub kernels (no network here)
    dequantized = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, quantization_config=dequantized
    ).eval()
    prompts = make_prompts(seed=4)[:4]
    refs = hf_greedy(model, prompts)
    runner = load_runner(
        str(directory), num_blocks=256, block_size=BLOCK_SIZE, quantization="none",
        kv_cache_dtype="float32",
    )  # fmt: skip
    expert = runner.model.layers[1].moe.experts[5].gate_up_proj.weight
    published = model.model.layers[1].mlp.experts.gate_up_proj[5].T  # gate, up alternating
    assert torch.equal(expert, torch.cat([published[::2], published[1::2]]))
    driver = Driver(runner)
    seqs = [driver.new_seq(p) for p in prompts]
    driver.step([(s, s.pending) for s in seqs])
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)
    # served as the file holds it: the experts' codes and exponents on the kernels, no float copy
    packed = load_runner(str(directory), num_blocks=64, block_size=BLOCK_SIZE, quantization="auto")
    assert packed.quantization == "int4" and "mxfp4" in packed.packed_precisions
    assert type(packed.model.layers[1].moe.experts[5].gate_up_proj).__name__ != "Linear"
    if packed.backend.info().name == "cpu-kernels":
        assert packed.backend.info().kernels["experts"] == "grouped on 3 of 3 layers"
    # the experts compute what the file holds (the float projections are requantized to 8 bits,
    # which moves this sensitive random model's logprobs by ~0.1 by itself)
    x = torch.randn(5, GPT_OSS["hidden_size"], generator=torch.Generator().manual_seed(0))
    for e in (0, 5):
        want = runner.model.layers[1].moe.experts[e].gate_up_proj(x)
        got = packed.model.layers[1].moe.experts[e].gate_up_proj(x)
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
    for prompt in prompts:
        ours, ref = (_prefill_logprobs(r, prompt) for r in (packed, runner))
        assert ours.argmax() == ref.argmax()


def _prefill_logprobs(runner, prompt: list[int]) -> torch.Tensor:
    from hf_parity import Driver

    driver = Driver(runner)
    seq = driver.new_seq(prompt)
    driver.step([(seq, seq.pending)])
    return seq.logprobs[0]


# ---------------------------------------------------------------------- --tp 2

RANK_SCRIPT = """
import json, sys
import torch
from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker.model_runner import ModelRunner
from pyserve.worker.offline import OfflineEngine
from pyserve.worker.settings import WorkerSettings
from pyserve.worker.tensor_parallel import TensorParallel

rank, size, init, model, out = sys.argv[1:6]
torch.set_num_threads(1)
tp = None if size == "1" else TensorParallel.join(int(rank), int(size), init, "cpu")
settings = WorkerSettings(
    model=model, num_blocks=64, quantization="none", dtype="float32", kv_cache_dtype="float32"
)
runner = ModelRunner(settings, tp=tp)
params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
outputs = OfflineEngine(runner=runner, num_blocks=64).generate(json.loads(sys.argv[6]), params)
if rank == "0":
    with open(out, "w") as f:
        json.dump([[o.token_ids, o.logprobs] for o in outputs], f)
if tp is not None:
    tp.close()
"""
RANK_PROMPTS = [[5, 9, 200, 17, 3], list(range(30, 70))]
TP_MODELS = {
    # a shared expert and a dense layer between sparse ones
    "qwen2_moe": {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "mlp_only_layers": [1],
    },
    # q/k normalized over the heads of both ranks
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    # each rank's heads' sinks, biases split with their rows (down's on rank 0 alone)
    "gpt_oss": {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
        "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
}  # fmt: skip


def _generate(model_dir: str, size: int, out) -> list:
    from http_testlib import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    rest = [model_dir, str(out), json.dumps(RANK_PROMPTS)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(size), init, *rest],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(size)
    ]
    try:
        assert [proc.wait(HANG_GUARD_S) for proc in ranks] == [0] * size
    finally:
        for proc in ranks:
            proc.kill()
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", list(TP_MODELS))
def test_tp2_splits_every_expert_and_equals_one_process(kind, tmp_path):
    make_tiny_model(tmp_path / "hf", kind, seed=5, **TP_MODELS[kind])
    one = _generate(str(tmp_path / "hf"), 1, tmp_path / "one.json")
    two = _generate(str(tmp_path / "hf"), 2, tmp_path / "two.json")
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(two, one, strict=True):
        assert tokens == want_tokens
        assert np.allclose(logprobs, want_logprobs, atol=1e-4)


# ---------------------------------------------------------------------- grouped matmuls


ISAS = quant.kernels().supported_isas()  # best first


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight_type", ["int4", "int8", "Q4_K", "Q6_K", "MXFP4"])
def test_grouped_experts_on_the_kernels_equal_the_loop_bit_for_bit(weight_type, isa):
    """The CPU kernels' grouped matmuls (every active expert's rows in one call a projection),
    with the routing grouped and the outputs summed back in C++, give what the loop over each
    expert's own layers gives, to the bit, on every ISA this CPU runs and every tile width:
    one token, many, experts no token picked."""
    from test_kernels import ggml_weight

    from pyserve.worker.backends.cpu.quant_linear import QuantLinear

    hidden, width = 256, 256  # K-quants: whole 256-input blocks on both projections
    layer = SparseMoE(hidden, MoEConfig(EXPERTS, 2, width, True), dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(2)
    for e, expert in enumerate(layer.experts):
        for name in ("gate_up_proj", "down_proj"):
            n, k = getattr(expert, name).weight.shape
            if weight_type.startswith("int"):
                weight = torch.randn((n, k), generator=gen) * 0.05
                linear = QuantLinear(weight, None, int(weight_type[3:]), max_kernel_rows=None)
            else:
                packed = ggml_weight(weight_type, n, k, seed=e)
                linear = QuantLinear.from_packed(packed, None, max_kernel_rows=None)
            setattr(expert, name, linear)
    quant.kernels().set_isa(isa)
    try:
        _check_grouped_routes(layer, gen)
    finally:
        quant.kernels().set_isa(ISAS[0])


def _check_grouped_routes(layer, gen, activation: str = "silu", scale: float = 1.0) -> None:
    """``layer``'s experts (QuantLinears) grouped on the kernels against the base backend's
    loop over them, to the bit: a decode token, many tokens, every token on two experts."""
    from pyserve.worker.backends import attention_backend
    from pyserve.worker.backends.base import Backend
    from pyserve.worker.backends.cpu.experts import ExpertKernels

    kernels = ExpertKernels.build(layer)
    assert kernels is not None
    backend = attention_backend(
        "cpu-kernels", heads=2, kv_heads=2, dim=16, num_layers=1, num_blocks=4, block_size=4,
        dtype=torch.float32,
    )  # fmt: skip
    first = torch.randint(0, EXPERTS, (40,), generator=gen)
    routes = {
        "a decode token": torch.tensor([[7, 1]]),
        "many tokens": torch.stack([first, (first + 3) % EXPERTS], dim=1),
        "every token on two experts": torch.tensor([[2, 5]] * 64),
    }
    for name, experts in routes.items():
        x = torch.randn(len(experts), layer.router.shape[1], generator=gen) * scale
        weights = torch.rand(experts.shape, generator=gen)
        got = kernels.run(x, weights, experts, activation, backend)
        want = Backend.run_experts(backend, layer, x, weights, experts, activation)
        assert torch.equal(got, want), name


def test_grouped_experts_with_biases_equal_the_loop_bit_for_bit():
    """gpt-oss's experts (a bias on gate/up and on down, the clamped SwiGLU) as grouped
    matmuls: each grouped row gets its own expert's bias, as the expert's layer adds it."""
    from pyserve.worker.backends.cpu.quant_linear import QuantLinear

    moe = MoEConfig(EXPERTS, 2, 64, True, expert_bias=True)
    layer = SparseMoE(64, moe, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(4)
    for expert in layer.experts:
        for name in ("gate_up_proj", "down_proj"):
            n, k = getattr(expert, name).weight.shape
            weight = torch.randn((n, k), generator=gen) * 0.05
            bias = torch.randn(n, generator=gen)
            setattr(expert, name, QuantLinear(weight, bias, 8, max_kernel_rows=None))
    # inputs 3x larger: gate/up values past the SwiGLU's clamp
    _check_grouped_routes(layer, gen, "clamped_swiglu", scale=3.0)


def test_a_gguf_with_fused_gate_up_experts_loads_as_the_unfused_one(tmp_path):
    """llama.cpp's converter with --fuse-gate-up-exps writes each layer's gate and up experts
    as one [experts, 2·width, hidden] tensor: the same model, the same logits."""
    from hf_parity import BLOCK_SIZE

    model = make_tiny_model(tmp_path / "hf", "qwen3_moe", seed=3, **QWEN3_MOE)
    plain, fused = tmp_path / "plain.gguf", tmp_path / "fused.gguf"
    write_gguf(model, plain)
    write_gguf(model, fused, fuse_gate_up_exps=True)
    import gguf

    names = {t.name for t in gguf.GGUFReader(fused).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_up_exps.weight" not in names
    prompt = list(range(5, 45))
    got, want = (
        _prefill_logprobs(
            load_runner(str(p), num_blocks=64, block_size=BLOCK_SIZE, quantization="none"), prompt
        )
        for p in (fused, plain)
    )
    assert torch.equal(got, want)


# ---------------------------------------------------------------------- llama.cpp's converter


CONVERTED = {
    # renormalized, as Qwen3-MoE checkpoints are: the converter writes no expert_weights_norm
    # and llama.cpp renormalizes every qwen3moe file (so does pyserve)
    "qwen3moe": {
        "head_dim": 16, "num_experts": 8, "moe_intermediate_size": 32, "norm_topk_prob": True,
    },
    "qwen2moe": {
        "num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    },
    "mixtral": {"num_local_experts": 8, "intermediate_size": 32},
    "olmoe": {"num_experts": 8, "intermediate_size": 32},
    "gpt-oss": {
        "head_dim": 16, "num_local_experts": 8, "intermediate_size": 32, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}  # fmt: skip


@pytest.mark.parametrize("family", list(CONVERTED))
def test_a_gguf_from_llama_cpps_own_converter_equals_the_hf_directory(family, tmp_path):
    """Each mixture-of-experts family written by llama.cpp's convert_hf_to_gguf.py itself (its
    names, stacked experts, metadata and tokenizer) loads into the model the HF directory
    gives: the same config, the same logprobs to float32 rounding."""
    from tiny_models import build_tiny_smollm

    source = required_converter()
    directory = build_tiny_smollm(
        tmp_path / "hf", seed=7, max_position_embeddings=1024, family=family,
        overrides={"num_experts_per_tok": 2, **CONVERTED[family]},
    )  # fmt: skip
    path = tmp_path / "converted.gguf"
    done = subprocess.run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), str(directory),
         "--outfile", str(path), "--outtype", "f32"],
        env={**os.environ, "PYTHONPATH": str(source / "gguf-py")},
        capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    options = {"num_blocks": 64, "block_size": 4, "quantization": "none"}
    hf = load_runner(str(directory), kv_cache_dtype="float32", **options)
    converted = load_runner(str(path), kv_cache_dtype="float32", **options)
    assert converted.config.features() == hf.config.features()
    from pyserve.model_files import load_tokenizer, resolve_model

    text = "Hello world, a tokenizer check: 12345 ünïcødé!"
    tokenizers = (load_tokenizer(resolve_model(str(p))) for p in (path, directory))
    assert len({tuple(t.encode(text)) for t in tokenizers}) == 1
    for prompt in ([5, 9, 200, 17, 3], list(range(30, 70))):
        ours, ref = (_prefill_logprobs(r, prompt) for r in (converted, hf))
        assert (ours - ref).abs().max() < 1e-4


# ---------------------------------------------------------------------- the kernel router


def _kernel_route(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    normalize: bool,
    shared=None,
    bias=None,
    softmax_after_top_k: bool = False,
):
    """_kernels.moe_route's (weights, experts, shared gate or None) for x [T, hidden]."""
    tokens, hidden = x.shape
    weights = torch.empty(tokens, top_k)
    experts = torch.empty(tokens, top_k, dtype=torch.int64)
    gate = None if shared is None else torch.empty(tokens)
    quant.kernels().moe_route(
        x.data_ptr(), hidden, tokens, hidden, router.data_ptr(), router.shape[0], top_k,
        normalize, weights.data_ptr(), experts.data_ptr(),
        0 if shared is None else shared.data_ptr(), 0 if gate is None else gate.data_ptr(),
        bias=0 if bias is None else bias.data_ptr(), softmax_after_top_k=softmax_after_top_k,
    )  # fmt: skip
    return weights, experts, gate


# (experts, k): torch.topk sorts with std::partial_sort where k · 64 <= experts, else with
# std::nth_element and a sort of the first k - 1; both regimes, k = 1 and k = experts
ROUTES = [(8, 1), (8, 2), (8, 4), (8, 8), (16, 2), (60, 4), (64, 1), (64, 8), (128, 2), (128, 8),
          (256, 2), (256, 4)]  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("num_experts", "top_k"), ROUTES)
def test_the_kernel_router_picks_torchs_experts_ties_included(num_experts, top_k, isa):
    """moe_route (the CPU backend's router, shared by its layer loop and its decoder stack)
    against SparseMoE.route in torch on exact ties: small integers make every logit exact in
    any summation order, so equal logits are equal in both, and the kernel must pick and order
    the tied experts as torch.topk does (its std::nth_element / std::partial_sort order, which
    the kernel reproduces, not "the lowest id first"). Weights within float32 rounding."""
    gen = torch.Generator().manual_seed(num_experts * 100 + top_k)
    hidden = 33  # a partial 16-lane block at the end
    x = torch.randint(-2, 3, (40, hidden), generator=gen).float()
    routers = {
        "all tied": torch.zeros(num_experts, hidden),
        "a few distinct logits": torch.randint(-1, 2, (3, hidden), generator=gen).float()[
            torch.randint(0, 3, (num_experts,), generator=gen)
        ],
        "many ties": torch.randint(-1, 2, (num_experts, hidden), generator=gen).float(),
    }
    layer = SparseMoE(hidden, MoEConfig(num_experts, top_k, 16, True), dtype=torch.float32,
                      device="cpu")  # fmt: skip
    quant.kernels().set_isa(isa)
    try:
        for name, router in routers.items():
            layer.router.data.copy_(router)
            for normalize in (False, True):
                layer.normalize = normalize
                want_weights, want_experts = layer.route(x)
                weights, experts, _ = _kernel_route(x, router, top_k, normalize)
                assert torch.equal(experts, want_experts), (name, normalize)
                torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    finally:
        quant.kernels().set_isa(ISAS[0])
    if top_k < num_experts:  # all tied: every token the same k experts, the others idle
        _, experts, _ = _kernel_route(x, routers["all tied"], top_k, False)
        assert (experts == experts[0]).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("num_experts", "top_k"), ROUTES)
def test_the_kernel_router_with_a_bias_and_softmax_after_top_k_is_sparse_moes(
    num_experts, top_k, isa
):
    """gpt-oss's routing on moe_route (a bias on the logits; the k largest logits, then a softmax
    over those k) against SparseMoE.route on exact ties (small integers: every logit and bias
    sum exact in any order), in both of torch.topk's regimes: the same experts in the same
    order, ties among the logits included, and weights within float32 rounding. With
    softmax_after_top_k the kernel ignores normalize, as SparseMoE.route does."""
    gen = torch.Generator().manual_seed(num_experts * 100 + top_k + 1)
    hidden = 33
    x = torch.randint(-2, 3, (40, hidden), generator=gen).float()
    routers = {
        "all tied": (torch.zeros(num_experts, hidden), torch.zeros(num_experts)),
        "ties left by the bias": (
            torch.randint(-1, 2, (num_experts, hidden), generator=gen).float(),
            torch.randint(-2, 3, (num_experts,), generator=gen).float(),
        ),
        "the bias alone": (
            torch.zeros(num_experts, hidden),
            torch.randint(-1, 2, (num_experts,), generator=gen).float(),
        ),
    }
    for softmax_after_top_k in (True, False):
        config = MoEConfig(
            num_experts, top_k, 16, True, router_bias=True, softmax_after_top_k=softmax_after_top_k
        )
        layer = SparseMoE(hidden, config, dtype=torch.float32, device="cpu")
        quant.kernels().set_isa(isa)
        try:
            for name, (router, bias) in routers.items():
                layer.router.data.copy_(router)
                layer.router_bias.data.copy_(bias)
                for normalize in (False, True):
                    layer.normalize = normalize
                    want_weights, want_experts = layer.route(x)
                    weights, experts, _ = _kernel_route(
                        x, router, top_k, normalize, bias=bias,
                        softmax_after_top_k=softmax_after_top_k,
                    )  # fmt: skip
                    where = (name, softmax_after_top_k, normalize)
                    assert torch.equal(experts, want_experts), where
                    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
        finally:
            quant.kernels().set_isa(ISAS[0])


def _on_every_isa_and_thread_count(call) -> list:
    """``call()``'s result on every ISA this CPU runs, with 1 and with 2 threads."""
    kernels = quant.kernels()
    threads = kernels.num_threads()
    results = []
    try:
        for isa in ISAS:
            kernels.set_isa(isa)
            for n in (1, 2):
                kernels.set_num_threads(n)
                results.append(call())
    finally:
        kernels.set_isa(ISAS[0])
        kernels.set_num_threads(threads)
    return results


def test_the_kernel_routers_softmax_after_top_k_on_random_logits():
    """Random float inputs (sums that round) with a bias, gpt-oss's mode: the same experts as
    SparseMoE.route, weights within float32 rounding, each token's k weights summing to 1 and
    in descending order, the same bits on every ISA and thread count."""
    gen = torch.Generator().manual_seed(11)
    hidden, num_experts, top_k = 72, 32, 4
    x = torch.randn(70, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen) * 0.3
    bias = torch.randn(num_experts, generator=gen)
    results = _on_every_isa_and_thread_count(
        lambda: _kernel_route(x, router, top_k, False, bias=bias, softmax_after_top_k=True)
    )
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][:2], other[:2], strict=True))
    config = MoEConfig(num_experts, top_k, 16, False, router_bias=True, softmax_after_top_k=True)
    layer = SparseMoE(hidden, config, dtype=torch.float32, device="cpu")
    layer.router.data.copy_(router)
    layer.router_bias.data.copy_(bias)
    want_weights, want_experts = layer.route(x)
    weights, experts, _ = results[0]
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(70))
    assert (weights[:, :-1] >= weights[:, 1:]).all()


def test_the_kernel_router_is_the_same_on_every_isa_and_thread_count():
    """Random float inputs (sums that round), with a shared gate: the same bits on every ISA
    and with 1 or 2 threads (the dot products sum in one order everywhere), and within float32
    rounding of torch's route and sigmoid gate."""
    gen = torch.Generator().manual_seed(7)
    hidden, num_experts, top_k = 72, 64, 4
    x = torch.randn(70, hidden, generator=gen)  # 70 · 65 · 72 products: the threaded path
    router = torch.randn(num_experts, hidden, generator=gen) * 0.3
    shared = torch.randn(hidden, generator=gen) * 0.3
    results = _on_every_isa_and_thread_count(lambda: _kernel_route(x, router, top_k, True, shared))
    first = results[0]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    layer = SparseMoE(hidden, MoEConfig(num_experts, top_k, 16, True, shared_expert_size=8),
                      dtype=torch.float32, device="cpu")  # fmt: skip
    layer.router.data.copy_(router)
    layer.shared_gate.data.copy_(shared[None])
    want_weights, want_experts = layer.route(x)
    weights, experts, gate = first
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gate[:, None], layer.shared_expert_gate(x), rtol=1e-5, atol=1e-7)


def test_the_kernel_router_checks_its_arguments():
    x, router = torch.zeros(2, 16), torch.zeros(8, 16)
    weights, experts, _ = _kernel_route(torch.zeros(0, 16), router, 2, False)  # a step of none
    assert weights.shape == experts.shape == (0, 2)
    with pytest.raises(ValueError, match="top-9 of 8 experts"):
        _kernel_route(x, router, 9, False)
    with pytest.raises(ValueError, match="a shared gate needs its output"):
        quant.kernels().moe_route(
            x.data_ptr(), 16, 2, 16, router.data_ptr(), 8, 2, False, x.data_ptr(),
            x.data_ptr(), router.data_ptr(), 0,
        )  # fmt: skip


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("router", ROUTERS)
def test_the_cpu_backends_route_matches_transformers_sparse_block(kind, router):
    """The CPU kernels backend's SparseMoE (its kernel router, the experts in torch, gpt-oss's
    clamped SwiGLU on the kernels) against transformers' block: ties, every token on one
    expert, idle experts, a shared gate, gpt-oss's router bias and softmax over the top k."""
    from pyserve.worker.backends import attention_backend
    from pyserve.worker.backends.cpu.experts import KernelRouter

    top_k = 2
    block, _ = _hf_block(kind, top_k)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gate = _router(block)
        if router == "ties":
            gate.weight.zero_()
            if kind == "gpt_oss":
                gate.bias.zero_()
        elif router == "one-expert-for-all":
            x = x.abs()
            gate.weight.fill_(-0.1)
            gate.weight[0] = 1.0
    ours = _ours(block, kind, top_k)
    backend = attention_backend(
        "cpu-kernels", heads=2, kv_heads=2, dim=16, num_layers=1, num_blocks=4, block_size=4,
        dtype=torch.float32,
    )  # fmt: skip
    kernel_router = KernelRouter.build(ours)
    assert kernel_router is not None
    backend.expert_routers[id(ours)] = kernel_router
    with torch.no_grad():
        want = block(x[None])[0]
        if kind == "gpt_oss":
            want = want[0]  # (output, router scores)
        got = ours(x, backend, "clamped_swiglu" if kind == "gpt_oss" else "silu")
        _, picked, gate = backend.route_experts(ours, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(picked, ours.route(x)[1])  # torch's choice, ties included
    assert (gate is None) == (kind != "qwen2_moe")


def test_a_routing_feature_the_kernel_router_lacks_leaves_the_route_to_torch(monkeypatch):
    """gpt-oss's MoEConfig fields (router bias, expert biases, softmax over the top-k logits)
    route on the kernels; a field beyond those the kernels compute (one taken out of
    ROUTE_FIELDS here, as a routing feature added to MoEConfig later would be), set away from
    its default: no kernel router, saying which field (and the stack refuses the mixture)."""
    from pyserve.worker.backends.cpu import experts
    from pyserve.worker.backends.cpu.experts import KernelRouter

    fields = ("router_bias", "expert_bias", "softmax_after_top_k")
    for field in (None, *fields):
        config = MoEConfig(EXPERTS, 2, WIDTH, True, **({field: True} if field else {}))
        layer = SparseMoE(HIDDEN, config, dtype=torch.float32, device="cpu")
        assert KernelRouter.unsupported(layer) is None
        assert KernelRouter.build(layer) is not None
    for field in fields:
        monkeypatch.setattr(experts, "ROUTE_FIELDS", experts.ROUTE_FIELDS - {field})
        config = MoEConfig(EXPERTS, 2, WIDTH, True, **{field: True})
        layer = SparseMoE(HIDDEN, config, dtype=torch.float32, device="cpu")
        assert KernelRouter.unsupported(layer) == f"the router's {field}"
        assert KernelRouter.build(layer) is None
        monkeypatch.undo()
    bf16 = SparseMoE(HIDDEN, MoEConfig(EXPERTS, 2, WIDTH, True), dtype=torch.bfloat16,
                     device="cpu")  # fmt: skip
    assert KernelRouter.unsupported(bf16) == "a torch.bfloat16 router"
