"""The decoder layers in one C++ call (pyserve/worker/backends/cpu_stack.py,
cpp/kernels/decoder_stack.*).

The stack makes the modules' kernel calls in their order on their values, so everything it
returns must be the module path's bit for bit: greedy tokens and logprobs over mixed batches
(prompt chunks after cached prefixes beside decodes, and all-decode steps), with q/k/v/o biases
and a Qwen2-like untied head. Then: where it does not apply it is not built, and the C++ checks
the weights it is given.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import random_llama
from worker_testlib import load_runner

from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker import quant
from pyserve.worker.backends.cpu_stack import CpuDecoderStack
from pyserve.worker.offline import OfflineEngine

STACK_RUNS = quant.kernels().isa() == "avx512_vnni"  # the prefill kernel and fused ops need it
needs_stack = pytest.mark.skipif(
    not STACK_RUNS,
    reason="this CPU lacks AVX-512 VNNI: the decoder stack is not built here and the worker runs "
    "the modules, which the other worker tests cover",
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """tiny_models' Llama with 3 layers, biases on q/k/v/o and an untied head."""
    directory = tmp_path_factory.mktemp("tiny")
    overrides = {"num_hidden_layers": 3, "intermediate_size": 96, "attention_bias": True}
    random_llama(256, 512, 3, **overrides).save_pretrained(directory)
    return str(directory)


WORKER_SETTINGS = ("quantization", "activation_bits", "kv_cache_dtype", "dtype", "backend")


def engine(model: str, stack: bool, **kw) -> OfflineEngine:
    """The CPU kernels backend with its decoder stack (``stack``) or its layer loop."""
    kw = {"quantization": "int4", "num_blocks": 96, "block_size": 8, **kw}
    settings = {k: kw.pop(k) for k in WORKER_SETTINGS if k in kw}
    settings.setdefault("backend", "cpu-kernels")
    runner = load_runner(
        model, num_blocks=kw["num_blocks"], block_size=kw["block_size"], **settings,
        backend_options={"use_stack": stack},
    )  # fmt: skip
    built = OfflineEngine(runner=runner, **kw)
    assert (built.runner.decoder_stack is not None) == stack, runner.backend.info()
    return built


@needs_stack
def test_the_stack_is_the_module_path_bit_for_bit(tiny_model):
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]  # a cached prefix for half the prompts
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 60))]
        for i in range(10)
    ]
    params = SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    # small chunks and 4 running: prompt chunks land beside decodes in most steps
    kw = {"chunked_prefill_size": 24, "max_prefill_tokens": 24, "max_running_requests": 4}
    want = engine(tiny_model, False, **kw).generate(prompts, params)
    got = engine(tiny_model, True, **kw).generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
        assert a.top_logprobs == b.top_logprobs


@needs_stack
def test_8_bit_activations_and_a_float16_cache_agree_too(tiny_model):
    prompts = [[5, 9, 200, 17], list(range(30, 90))]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    kw = {"activation_bits": 8, "kv_cache_dtype": "float16"}
    want = engine(tiny_model, False, **kw).generate(prompts, params)
    got = engine(tiny_model, True, **kw).generate(prompts, params)
    assert [(o.token_ids, o.logprobs) for o in want] == [(o.token_ids, o.logprobs) for o in got]


def test_not_built_where_it_does_not_apply(tiny_model):
    def stack_of(**kw) -> tuple[object, str]:
        runner = load_runner(tiny_model, num_blocks=16, **kw)
        return runner.decoder_stack, runner.backend.info().kernels.get("decoder_stack", "")

    # float32 weights through torch (no kernel linears), and bfloat16
    for kw in ({"quantization": "none"}, {"quantization": "none", "dtype": "bfloat16"}):
        stack, why = stack_of(**kw)
        assert stack is None and why.startswith("off: "), why
    stack, _ = stack_of(quantization="int4", backend="torch")  # the reference has no stack
    assert stack is None
    stack, why = stack_of(quantization="int4")
    assert (stack is not None) == STACK_RUNS and why == ("on" if STACK_RUNS else why)
    runner = load_runner(tiny_model, num_blocks=16, quantization="int4")
    plan = runner.backend.plan
    built, why = CpuDecoderStack.build(runner.model, runner.kv_cache, plan)
    assert (built is not None) == STACK_RUNS, why


def test_a_model_beyond_the_stack_is_refused_and_runs_its_layers(tmp_path):
    """A Qwen3 (q/k norms) is the Llama block plus a norm the stack does not compute: the stack
    refuses it, saying so, instead of running a Llama."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    runner = load_runner(str(tmp_path), num_blocks=16, quantization="int4")
    why = runner.backend.info().kernels.get("decoder_stack", "")
    assert runner.decoder_stack is None and "q/k norm" in why, why


def test_the_cpp_stack_checks_the_weights_it_is_given():
    kernels = quant.kernels()
    stack = kernels.DecoderStack(
        hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=96, eps=1e-5,
        cache_dtype=0, num_blocks=8, block_size=8,
    )  # fmt: skip
    packed = {
        name: quant.quantize_weight(torch.randn(n, k), 4)
        for name, (n, k) in {"qkv": (128, 64), "o": (64, 64), "gate_up": (192, 64)}.items()
    }

    def linear(p):
        return (p.data.data_ptr(), p.scales.data_ptr(), p.n, p.k, p.bits, p.group, 0, 16)

    norm = torch.ones(64)
    cache = torch.zeros(2, 8, 8, 16)
    args = [linear(packed[n]) for n in ("qkv", "o", "gate_up")]
    with pytest.raises(ValueError, match="down: 192x64 weights, expected 64x96"):
        stack.add_layer(norm.data_ptr(), norm.data_ptr(), *args, args[2], cache.data_ptr(),
                        cache.data_ptr())  # fmt: skip
    with pytest.raises(ValueError, match="expected 8 fields"):
        stack.add_layer(norm.data_ptr(), norm.data_ptr(), *args, (1, 2), cache.data_ptr(),
                        cache.data_ptr())  # fmt: skip
    assert stack.num_layers == 0
