"""The decoder layers in one C++ call (pyserve/worker/backends/cpu/stack.py,
cpp/kernels/decoder_stack.*).

The stack makes the modules' kernel calls in their order on their values, so everything it
returns must be the module path's bit for bit: greedy tokens and logprobs over mixed batches
(prompt chunks after cached prefixes beside decodes, and all-decode steps), with q/k/v/o biases
and a Qwen2-like untied head, and for every family of test_model_families.py with its features
on (q/k norms, sandwich norms, GELU-tanh, sliding windows, soft-caps, several rope tables,
partial rotary), with float32 and float16 caches. Then: where it does not apply it is not built,
saying why, and the C++ checks the weights and tables it is given.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from gguf_files import write_gguf
from hf_parity import make_tiny_model
from test_gguf_packing import MIXED, TYPES
from test_model_families import FAMILIES, MOE_FAMILIES, SERVED_CONTEXT
from test_model_loading import tiny_llama
from tiny_models import random_llama
from worker_testlib import load_runner

from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker import quant
from pyserve.worker.backends.cpu.backend import LayerPlan
from pyserve.worker.backends.cpu.stack import CpuDecoderStack, unsupported
from pyserve.worker.models.decoder import DecoderLayer
from pyserve.worker.models.moe import SparseMoE
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


WORKER_SETTINGS = (
    "quantization", "activation_bits", "kv_cache_dtype", "dtype", "backend", "max_model_len",
)  # fmt: skip


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


def assert_stack_matches_layer_loop(model: str, num_prompts: int = 10, **kw) -> None:
    """Greedy tokens, logprobs and top logprobs of the stack and of the layer loop, equal, over
    mixed batches: small chunks and 4 running put prompt chunks (half of them after a cached
    prefix) beside decodes in most steps, and the tail decodes alone."""
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]  # a cached prefix for half the prompts
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 60))]
        for i in range(num_prompts)
    ]
    params = SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    kw = {"chunked_prefill_size": 24, "max_prefill_tokens": 24, "max_running_requests": 4, **kw}
    want = engine(model, False, **kw).generate(prompts, params)
    stack = engine(model, True, **kw)
    assert stack.runner.backend.info().kernels["decoder_stack"] == "on"
    got = stack.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
        assert a.top_logprobs == b.top_logprobs


@needs_stack
def test_the_stack_is_the_module_path_bit_for_bit(tiny_model):
    assert_stack_matches_layer_loop(tiny_model)


@needs_stack
def test_projections_kept_at_their_parts_precisions_run_on_the_stack(tmp_path):
    """A GGUF whose q/k and v (gate and up) differ in precision (test_gguf_packing's mix of
    types) keeps each at its own, as row segments: the stack computes them as the layer loop."""
    path = str(tmp_path / "mixed.gguf")
    write_gguf(tiny_llama(**MIXED), tmp_path / "mixed.gguf", tensor_types=TYPES)
    model = engine(path, True, quantization="auto").runner.model
    assert isinstance(model.layers[0].qkv_proj.packed, quant.SegmentedWeight)
    assert_stack_matches_layer_loop(path, num_prompts=6, quantization="auto")


def saved_family(name: str, tmp_path_factory) -> tuple[str, str]:
    kind, overrides = FAMILIES[name]
    directory = tmp_path_factory.mktemp(name)
    make_tiny_model(directory, kind, seed=17, **overrides)
    return name, str(directory)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory) -> tuple[str, str]:
    """(name, directory) of test_model_families' tiny model of each family, features on (the
    mixtures of experts too: the kernel router, grouped experts, a shared expert, OLMoE's q/k
    norms over all heads)."""
    return saved_family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe_family_model(request, tmp_path_factory) -> tuple[str, str]:
    return saved_family(request.param, tmp_path_factory)


@needs_stack
@pytest.mark.parametrize("cache", ["float32", "float16"])
def test_every_family_on_the_stack_is_its_layer_loop_bit_for_bit(family_model, cache):
    name, directory = family_model
    served = SERVED_CONTEXT.get(name)
    assert_stack_matches_layer_loop(
        directory, num_prompts=8, kv_cache_dtype=cache, max_model_len=served
    )


def moe_model(directory, kind: str, router: str) -> str:
    """test_model_families' tiny ``kind`` mixture (qwen2_moe: with its shared expert and a
    dense layer) with every sparse layer's router set to ``router``: "zero" (every probability
    equal: every token on the same k experts, torch.topk's choice among ties, the other experts
    idle) or "plus-minus" (experts 0 and 1 opposite, the rest 0: each token's first choice is 0
    or 1, its second a tie among the six zero logits)."""
    name = {"qwen2_moe": "qwen2moe-shared", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss-window"}
    model = make_tiny_model(directory, kind, seed=17, **FAMILIES[name[kind]][1])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "router" if kind == "gpt_oss" else "gate", None)
            if gate is None:  # a dense layer
                continue
            gate.weight.zero_()
            if getattr(gate, "bias", None) is not None:  # gpt-oss's router bias
                gate.bias.zero_()
            if router == "plus-minus":
                direction = torch.randn(gate.weight.shape[1], generator=gen)
                gate.weight[0], gate.weight[1] = direction, -direction
    model.save_pretrained(directory)
    return str(directory)


@needs_stack
@pytest.mark.parametrize("router", ["zero", "plus-minus"])
@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_routes_with_ties_idle_experts_and_one_expert_for_all_on_the_stack(tmp_path, kind, router):
    """Routers that tie (all experts, or the six after each token's first choice), send every
    token to the same experts and leave others without a token: the stack routes as the layer
    loop does, to the bit, over mixed batches and prefix hits (gpt-oss: ties among the logits,
    its top k picked before the softmax)."""
    assert_stack_matches_layer_loop(moe_model(tmp_path, kind, router), num_prompts=6)


@needs_stack
@pytest.mark.parametrize("matrix_type", ["Q8_0", "MXFP4"])
def test_a_quantized_gpt_oss_file_runs_on_the_stack(tmp_path, matrix_type):
    """gpt-oss as a GGUF of Q8_0 or MXFP4 matrices (the stacked experts with their stacked
    biases, q/k/v/o biases, sinks): the experts grouped, the clamped SwiGLU on the kernels and
    the whole model on the stack, which equals the layer loop to the bit."""
    import gguf

    kind, overrides = FAMILIES["gpt-oss-window"]
    model = make_tiny_model(tmp_path / "hf", kind, seed=1, **overrides)
    path = tmp_path / f"gpt-oss-{matrix_type}.gguf"
    write_gguf(model, path, matrix_type=getattr(gguf.GGMLQuantizationType, matrix_type))
    built = engine(str(path), True, quantization="auto", kv_cache_dtype="float32")
    info = built.runner.backend.info().kernels
    assert info["decoder_stack"] == "on", info
    assert info["gated_activation"] == "kernels" and info["attention"] == "kernels", info
    assert info["experts"] == "grouped on 3 of 3 layers", info
    expert = built.runner.model.layers[0].moe.experts[3]
    assert expert.gate_up_proj.bias is not None
    assert expert.gate_up_proj.packed.mxfp4 == (matrix_type == "MXFP4")
    assert_stack_matches_layer_loop(str(path), num_prompts=6, quantization="auto")


@needs_stack
def test_a_mixture_of_experts_step_is_one_stack_call(moe_family_model, monkeypatch):
    """With the stack on, a mixture's steps never enter the layer loop (neither a decoder layer
    nor a SparseMoE runs in Python): each forward is one DecoderStack.forward, and the backend
    says so."""
    _, directory = moe_family_model
    built = engine(directory, True)
    info = built.runner.backend.info().kernels
    assert info["decoder_stack"] == "on" and info["experts"].startswith("grouped on ")
    assert info["moe_router"] == info["experts"].replace("grouped", "kernels")
    calls = []
    stack = built.runner.decoder_stack
    run = stack.run
    monkeypatch.setattr(stack, "run", lambda *a, **kw: calls.append(1) or run(*a, **kw))

    def no_loop(*args, **kwargs):
        raise AssertionError("the layer loop ran")

    monkeypatch.setattr(DecoderLayer, "forward", no_loop)
    monkeypatch.setattr(SparseMoE, "forward", no_loop)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = built.generate([[5, 9, 200, 17], list(range(30, 70))], params)
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    assert len(calls) >= 6  # a prefill, then a decode step a token


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


def test_what_the_stack_cannot_run_is_refused_saying_why_and_runs_its_layers(tiny_model):
    """A bfloat16 model (int4 linears on the kernels, but the stack computes in float32): not
    built, the reason in the backend's info, and the layer loop generates."""
    runner = load_runner(tiny_model, num_blocks=16, quantization="int4", dtype="bfloat16")
    why = runner.backend.info().kernels.get("decoder_stack", "")
    assert runner.decoder_stack is None, why
    if STACK_RUNS:
        assert why == "off: the model runs in torch.bfloat16, the stack in float32", why
    else:  # the first reason this CPU gives (e.g. AVX2: the attention kernels are not in use)
        assert why.startswith("off: "), why
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    (out,) = OfflineEngine(runner=runner, num_blocks=16).generate([[5, 9, 200, 17]], params)
    assert len(out.token_ids) == 4


@needs_stack
def test_a_layer_off_the_kernels_or_another_eps_is_refused(tiny_model):
    """What the plan runs on torch for one layer, and norms with different eps (the stack has
    one eps), are refused with the layer and the reason."""
    runner = load_runner(tiny_model, num_blocks=16, quantization="int4")
    model, cache, plan = runner.model, runner.kv_cache, runner.backend.plan
    assert unsupported(model, cache, plan) is None
    layers = list(plan.layers)
    torch_layer = replace(plan, layers=[*layers[:1], LayerPlan("torch: why", "fused"), *layers[2:]])
    assert unsupported(model, cache, torch_layer) == "layer 1: attention on torch: why"
    unfused = replace(plan, layers=[*layers[:2], LayerPlan("kernels", "torch: why")])
    assert unsupported(model, cache, unfused) == "layer 2: rope + KV write on torch: why"
    model.layers[1].mlp_norm.eps = 1e-3
    assert unsupported(model, cache, plan) == "the norms' eps differ"


def test_the_cpp_stack_checks_the_weights_and_tables_it_is_given():
    kernels = quant.kernels()
    stack = kernels.DecoderStack(
        hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=96, eps=1e-5,
        cache_dtype=0, num_blocks=8, block_size=8,
    )  # fmt: skip
    packed = {
        name: quant.quantize_weight(torch.randn(n, k), 4)
        for name, (n, k) in {
            "qkv": (128, 64), "o": (64, 64), "gate_up": (192, 64), "down": (64, 96)
        }.items()
    }  # fmt: skip

    def linear(p):
        return (p.data.data_ptr(), p.scales.data_ptr(), p.n, p.k, p.bits, p.group, 0, 16)

    norm, head_norm = torch.ones(64), torch.ones(16)
    cache = torch.zeros(2, 8, 8, 16)
    args = [linear(packed[n]) for n in ("qkv", "o", "gate_up")]
    with pytest.raises(ValueError, match="down: 192x64 weights, expected 64x96"):
        stack.add_layer(norm.data_ptr(), norm.data_ptr(), *args, args[2], cache.data_ptr(),
                        cache.data_ptr())  # fmt: skip
    with pytest.raises(ValueError, match="expected 8 to 10 fields"):
        stack.add_layer(norm.data_ptr(), norm.data_ptr(), *args, (1, 2), cache.data_ptr(),
                        cache.data_ptr())  # fmt: skip
    layer = (norm.data_ptr(), norm.data_ptr(), *args, linear(packed["down"]), cache.data_ptr(),
             cache.data_ptr())  # fmt: skip
    with pytest.raises(ValueError, match="a q_norm without a k_norm"):
        stack.add_layer(*layer, q_norm=head_norm.data_ptr())
    with pytest.raises(ValueError, match="a q_norm without a k_norm, or a k_norm without"):
        stack.add_layer(*layer, k_norm=head_norm.data_ptr())
    with pytest.raises(ValueError, match="rope table 1 of 1: out of range"):
        stack.add_layer(*layer, rope_table=1)
    with pytest.raises(ValueError, match="rope table -1 of 1: out of range"):
        stack.add_layer(*layer, rope_table=-1)
    with pytest.raises(ValueError, match="window must be >= 0"):
        stack.add_layer(*layer, window=-1)
    # a projection as row segments (a list of tuples): their rows add up, their inputs agree
    q, kv = (quant.quantize_weight(torch.randn(n, 64), bits) for n, bits in ((64, 4), (64, 8)))
    wide = quant.quantize_weight(torch.randn(64, 96), 8)
    for segments, match in (
        ([linear(q)], "qkv: 64x64 weights, expected 128x64"),
        ([linear(q), linear(wide)], "qkv: 128x64/96 weights, expected 128x64"),
        ([], "no segments"),
        ([linear(q), (*linear(kv)[:-1], 8)], "segments must share activation bits"),
    ):
        with pytest.raises(ValueError, match=match):
            stack.add_layer(norm.data_ptr(), norm.data_ptr(), segments, *layer[3:])
    assert stack.num_layers == 0
    stack.add_layer(norm.data_ptr(), norm.data_ptr(), [linear(q), linear(kv)], *layer[3:])
    assert stack.num_layers == 1
    stack.add_layer(*layer, q_norm=head_norm.data_ptr(), k_norm=head_norm.data_ptr(), window=4)
    assert stack.num_layers == 2 and stack.num_rope_tables == 1

    # the model-wide arguments: each rope table's rotary dims, the activation, the soft-cap
    shape = {
        "hidden": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate": 96,
        "eps": 1e-5, "cache_dtype": 0, "num_blocks": 8, "block_size": 8,
    }  # fmt: skip
    two_tables = kernels.DecoderStack(**shape, activation="gelu_tanh", rotary_dims=[16, 8])
    assert two_tables.num_rope_tables == 2
    two_tables.add_layer(*layer, rope_table=1)
    with pytest.raises(ValueError, match="rope table 2 of 2: out of range"):
        two_tables.add_layer(*layer, rope_table=2)
    for dims, match in (([18], "rotary_dim 18 must be even"), ([16, 7], "rope table 1: rotary")):
        with pytest.raises(ValueError, match=match):
            kernels.DecoderStack(**shape, rotary_dims=dims)
    with pytest.raises(ValueError, match="activation relu: silu, gelu_tanh or clamped_swiglu"):
        kernels.DecoderStack(**shape, activation="relu")
    for alpha, limit in ((1.702, 0.0), (float("nan"), 7.0)):
        with pytest.raises(ValueError, match="the clamped SwiGLU's alpha and limit"):
            kernels.DecoderStack(
                **shape, activation="clamped_swiglu", swiglu_alpha=alpha, swiglu_limit=limit
            )
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        kernels.DecoderStack(**shape, softcap=-1.0)

    # a forward must bring one cos and one sin per table (checked before anything is read)
    hidden, residual = torch.zeros(1, 64), torch.zeros(1, 64)
    slots, rope = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 16)

    def forward(cos, sin):
        two_tables.forward(
            1, hidden.data_ptr(), residual.data_ptr(), cos, sin, slots.data_ptr(),
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0.25,
        )  # fmt: skip

    with pytest.raises(ValueError, match="1 rope tables, the stack has 2"):
        forward([rope.data_ptr()], [rope.data_ptr()])
    with pytest.raises(ValueError, match="as many sin tables as cos tables"):
        forward([rope.data_ptr()] * 2, [rope.data_ptr()])
    with pytest.raises(ValueError, match="a rope table's null address"):
        forward([rope.data_ptr(), 0], [rope.data_ptr()] * 2)


def test_a_mixture_the_stack_cannot_run_is_refused_saying_why(moe_family_model):
    """A mixture runs on the stack with both its kernel router and its grouped experts; without
    either the stack is refused, naming the layer and what is missing."""
    _, directory = moe_family_model
    runner = load_runner(directory, num_blocks=16, quantization="int4")
    backend = runner.backend
    model, cache, plan = runner.model, runner.kv_cache, backend.plan
    grouped, routers = backend.expert_kernels, backend.expert_routers
    first = next(i for i, layer in enumerate(model.layers) if layer.moe is not None)
    if STACK_RUNS:
        assert unsupported(model, cache, plan, grouped, routers) is None
    assert unsupported(model, cache, plan, {}, routers) == (
        f"layer {first}: a mixture of experts: its experts are not grouped on the kernels"
    )
    assert unsupported(model, cache, plan, grouped, {}) == (
        f"layer {first}: a mixture of experts: its router is not on the kernels (not built)"
    )


def test_the_cpp_stack_checks_a_mixtures_experts():
    kernels = quant.kernels()
    hidden, width, num_experts = 64, 32, 4
    stack = kernels.DecoderStack(
        hidden=hidden, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=96, eps=1e-5,
        cache_dtype=0, num_blocks=8, block_size=8,
    )  # fmt: skip
    weights = {
        "qkv": quant.quantize_weight(torch.randn(128, hidden), 4),
        "o": quant.quantize_weight(torch.randn(hidden, hidden), 4),
        "gate_up": quant.quantize_weight(torch.randn(2 * width, hidden), 4),
        "down": quant.quantize_weight(torch.randn(hidden, width), 4),
        "wide_down": quant.quantize_weight(torch.randn(hidden, 2 * width), 4),
    }

    def linear(p):
        return (p.data.data_ptr(), p.scales.data_ptr(), p.n, p.k, p.bits, p.group, 0, 16)

    def expert_set(p, count=num_experts):
        experts = kernels.ExpertSet()
        for _ in range(count):
            experts.add(p.data.data_ptr(), p.scales.data_ptr(), p.n, p.k, p.bits, p.group, False)
        return experts

    router, norm, cache = torch.zeros(num_experts, hidden), torch.ones(hidden), torch.zeros(64)
    gate_up, down = expert_set(weights["gate_up"]), expert_set(weights["down"])
    layer = (norm.data_ptr(), norm.data_ptr(), linear(weights["qkv"]), linear(weights["o"]))
    caches = (cache.data_ptr(), cache.data_ptr())

    def moe(**kw):
        args = {
            "router": router.data_ptr(), "num_experts": num_experts, "top_k": 2,
            "normalize": True, "gate_up": gate_up, "down": down, "activation_bits": 16, **kw,
        }  # fmt: skip
        return kernels.StackMoE(**args)

    def add(mixture, gate_up_linear=None, down_linear=None, **kw):
        stack.add_layer(*layer, gate_up_linear, down_linear, *caches, moe=mixture, **kw)

    for mixture, match in (
        (moe(num_experts=5), "4 gate/up and 4 down experts for a router of 5"),
        (moe(top_k=5), "top-5 of 4 experts"),
        (moe(down=expert_set(weights["wide_down"])), "expert 0's weights are 64x64 and 64x64"),
        (moe(down=expert_set(weights["down"], 3)), "4 gate/up and 3 down experts"),
        (moe(activation_bits=4), "activation bits 8 or 16"),
    ):
        with pytest.raises(ValueError, match=match):
            add(mixture)
    with pytest.raises(ValueError, match="a shared expert needs its gate and both projections"):
        moe(shared_gate=norm.data_ptr())
    with pytest.raises(ValueError, match="router"):
        moe(router=0)
    with pytest.raises(ValueError, match="gate_up and down, or a mixture of experts"):
        add(moe(), linear(weights["gate_up"]), linear(weights["down"]))
    with pytest.raises(ValueError, match="gate_up and down, or a mixture of experts"):
        add(None)
    with pytest.raises(ValueError, match="a full-width q/k norm without its weights"):
        add(moe(), full_width_qk_norm=True)
    shared = moe(
        shared_gate=norm.data_ptr(), shared_gate_up=linear(weights["gate_up"]),
        shared_down=linear(weights["wide_down"]),
    )  # fmt: skip
    with pytest.raises(ValueError, match="moe shared gate_up: 64x64 weights, expected 128x64"):
        add(shared)
    assert stack.num_layers == 0
    add(moe())
    shared = moe(
        shared_gate=norm.data_ptr(), shared_gate_up=linear(weights["gate_up"]),
        shared_down=linear(weights["down"]),
    )  # fmt: skip
    add(shared, q_norm=norm.data_ptr(), k_norm=norm.data_ptr(), full_width_qk_norm=True)
    assert stack.num_layers == 2
