"""Serving quantized models: the `quantization` setting from the CLI to the ModelRunner, what
`auto` resolves to, and int4 on the default GGUF against float32 greedy decoding.

The kernels themselves (packing, accuracy per matmul) are tested in tests/test_kernels.py; the
server that answers in int4 is tests/test_http_default_model.py (the default server quantizes).
"""

from __future__ import annotations

import types

import pytest
import torch
from worker_testlib import one_torch_thread  # noqa: F401 (an autouse fixture)

from pyserve.cli import build_parser, engine_config
from pyserve.engine import EngineConfig
from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker.backends.cpu.quant_linear import QuantLinear
from pyserve.worker.dtypes import default_dtype, resolve_quantization
from pyserve.worker.loading.gguf import ggml_type_bits, quantization_hint
from pyserve.worker.model_runner import ModelRunner
from pyserve.worker.offline import OfflineEngine
from pyserve.worker.settings import WorkerSettings

# SmolLM2's tokens for its chat template around "What is the capital of France?", for
# "def fibonacci(n):" and for "The history of the Roman Empire".
CHAT_PROMPT = (
    "1 9690 198 2683 359 253 5356 5646 11173 3365 3511 308 34519 28 7018 411 407 19712 8182 2 198 "
    "1 4093 198 1780 314 260 3575 282 4649 47 2 198 1 520 9531 198"
)
PROMPTS = [
    [int(token) for token in CHAT_PROMPT.split()],
    [1604, 3987, 46477, 24, 94, 727],
    [504, 1463, 282, 260, 4469, 7057],
]
NEW_TOKENS = 16
NEAR_TIE = 0.01  # logprob gap under which int16-rounded activations may flip fp32's top token


# ---------------------------------------------------------------------------- settings


def test_auto_follows_the_file_where_quantized_kernels_exist():
    assert resolve_quantization("auto", "cpu", "int4") == "int4"
    assert resolve_quantization("auto", "cpu", "int8") == "int8"
    assert resolve_quantization("auto", "cpu", None) == "none"
    assert resolve_quantization("auto", "cuda", "int4") == "int4"  # the Triton kernels
    assert resolve_quantization("int4", "cuda:0", None) == "int4"
    assert resolve_quantization("auto", "mps", "int4") == "none"
    assert resolve_quantization("none", "cpu", "int4") == "none"
    assert resolve_quantization("int8", "cpu", "int4") == "int8"  # explicit wins over the file
    with pytest.raises(ValueError, match="CPU and CUDA devices only"):
        resolve_quantization("int4", "mps", None)
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int3", "cpu", None)
    # the kernels compute in float32: auto dtype is float32 whenever linears are quantized
    assert default_dtype("cpu", "int4") == default_dtype("cpu", "int8") == "float32"


def test_hint_from_ggml_types():
    def tensor(name: str, type_name: str, n: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            name=name, tensor_type=types.SimpleNamespace(name=type_name), n_elements=n
        )

    assert [ggml_type_bits(t) for t in ("Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0", "IQ2_XS")] == [
        4,
        4,
        5,
        6,
        8,
        2,
    ]
    assert ggml_type_bits("F16") is ggml_type_bits("BF16") is ggml_type_bits("F32") is None
    norms = [tensor("blk.0.attn_norm.weight", "F32", 10**6)]  # not a projection: ignored
    q4_k_m = [  # mostly Q4_K, a few tensors in Q6_K: served by the type holding most weights
        tensor("blk.0.attn_q.weight", "Q4_K", 1000),
        tensor("blk.0.ffn_up.weight", "Q4_K", 3000),
        tensor("blk.0.ffn_down.weight", "Q6_K", 3000),
        tensor("token_embd.weight", "Q8_0", 10**6),  # the embedding/head: ignored
    ]
    assert quantization_hint(norms + q4_k_m) == "int4"
    assert quantization_hint([tensor("blk.3.ffn_down.weight", "Q6_K", 10)]) == "int8"
    assert quantization_hint([tensor("blk.3.ffn_down.weight", "Q5_1", 10)]) == "int8"
    assert quantization_hint([tensor("blk.3.attn_v.weight", "Q8_0", 10)]) == "int8"
    assert quantization_hint([*norms, tensor("blk.0.attn_q.weight", "F16", 10)]) is None
    assert quantization_hint(norms) is None


def test_engine_config_and_cli():
    assert EngineConfig().quantization == "auto"
    EngineConfig().validate()
    EngineConfig(quantization="int8").validate()
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4").validate()
    EngineConfig(quantization="int4", device="cuda").validate()  # the Triton kernels
    with pytest.raises(ValueError, match="CPU and CUDA devices only"):
        EngineConfig(quantization="int4", device="mps").validate()
    EngineConfig(device="cuda").validate()
    parser = build_parser()
    assert engine_config(parser.parse_args(["run"])).quantization == "auto"
    config = engine_config(parser.parse_args(["run", "--quantization", "int4"]))
    assert config.quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--quantization", "fp8"])
    assert "--quantization" in parser._subparsers._group_actions[0].choices["run"].format_help()
    assert engine_config(parser.parse_args(["run"])).activation_bits == 16
    assert engine_config(parser.parse_args(["run", "--activation-bits", "8"])).activation_bits == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--activation-bits", "4"])
    with pytest.raises(ValueError, match="activation_bits"):
        EngineConfig(activation_bits=4).validate()


# ---------------------------------------------------------------------------- models


def test_auto_is_none_for_safetensors_and_int8_runs_a_tiny_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    prompt = [[1, 5, 77, 3, 100, 42, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=2)
    auto = OfflineEngine(str(tmp_path), quantization="auto", num_blocks=16, block_size=4)
    assert auto.runner.quantization == "none" and auto.runner.quantized_linears == 0
    int8 = OfflineEngine(str(tmp_path), quantization="int8", num_blocks=16, block_size=4)
    assert int8.runner.quantization == "int8"
    linears = [m for m in int8.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == int8.runner.quantized_linears == 2 * 4 + 1
    assert all(m.bits == 8 for m in linears)
    [want], [got] = auto.generate(prompt, params), int8.generate(prompt, params)
    assert_same_greedy(want, got, tolerance=0.05)  # int8 re-rounds the float weights
    # prefill chunks of 3 tokens: the first two steps sample nothing, so the quantized output
    # projection gets no rows (it used to hand the kernel a null pointer)
    chunked = OfflineEngine(
        str(tmp_path), quantization="int8", num_blocks=16, block_size=4,
        chunked_prefill_size=3, max_prefill_tokens=3,
    )  # fmt: skip
    [split] = chunked.generate(prompt, params)
    assert_same_greedy(got, split, tolerance=1e-3)


@pytest.fixture(scope="module")
def default_model_outputs():
    """Greedy continuations of PROMPTS by the default GGUF in float32, with top-2 logprobs."""
    engine = OfflineEngine(None, quantization="none", num_blocks=64, block_size=16)
    assert engine.runner.quantization == "none"
    return engine.generate(PROMPTS, greedy_with_gaps())


def greedy_with_gaps() -> SamplingParams:
    return SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2
    )


def assert_same_greedy(want, got, tolerance: float) -> None:
    """Identical greedy tokens up to the first position where fp32's top two are within
    ``tolerance``; after such a near-tie the continuations may differ legitimately."""
    for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
        (_, first), (_, second) = want.top_logprobs[i]
        if first - second < tolerance:
            return
        assert a == b, f"token {i}: {b} instead of {a} (fp32 top-2 gap {first - second:.4f})"


def test_default_gguf_auto_is_int4_and_agrees_with_float32(default_model_outputs):
    engine = OfflineEngine(None, quantization="auto", num_blocks=64, block_size=16)
    runner = engine.runner
    assert runner.quantization == "int4" and runner.dtype == torch.float32
    config = runner.config
    assert runner.quantized_linears == 4 * config.num_layers + 1  # fused qkv, o, gate_up, down
    assert runner.model.lm_head.bits == 8  # the head stays 8-bit, like the file's Q8_0
    assert runner.model.layers[0].qkv_proj.bits == 4
    outputs = engine.generate(PROMPTS, greedy_with_gaps())
    for want, got in zip(default_model_outputs, outputs, strict=True):
        assert_same_greedy(want, got, NEAR_TIE)
        # while the contexts are equal, logprobs move only by the activations' int16 rounding
        agreeing = next(
            (
                i
                for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True))
                if a != b
            ),
            NEW_TOKENS,
        )
        assert agreeing > 0
        pairs = zip(want.logprobs[:agreeing], got.logprobs[:agreeing], strict=True)
        moved = [abs(a - b) for a, b in pairs]
        assert max(moved) < 0.01, moved


def test_8_bit_activations_are_llama_cpp_close(default_model_outputs):
    """``activation_bits=8`` (llama.cpp's Q8_1 numerics) in the decoder layers, int16 kept in
    the output projection: greedy tokens follow float32's except at small top-2 gaps, and
    logprobs move by the int8 rounding (RESULTS.md "Kernels": mean ~0.04 over all linears)."""
    engine = OfflineEngine(None, quantization="auto", activation_bits=8, num_blocks=64)
    model = engine.runner.model
    assert model.lm_head.activation_bits == 16
    assert {layer.qkv_proj.activation_bits for layer in model.layers} == {8}
    outputs = engine.generate(PROMPTS, greedy_with_gaps())
    moved = []
    for want, got in zip(default_model_outputs, outputs, strict=True):
        assert_same_greedy(want, got, 0.5)
        agreeing = next(
            (i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b),  # noqa: B905
            NEW_TOKENS,
        )
        pairs = zip(want.logprobs[:agreeing], got.logprobs[:agreeing], strict=True)
        moved += [abs(a - b) for a, b in pairs]
    assert sum(moved) / len(moved) < 0.1 and max(moved) < 1.0, moved


def test_explicit_quantization_without_kernels_fails_before_loading():
    with pytest.raises(ValueError, match="CPU and CUDA devices only"):
        ModelRunner(WorkerSettings(quantization="int4", device="meta", num_blocks=4, block_size=16))
