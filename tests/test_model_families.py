"""Every registered family against Hugging Face transformers, in float32 with quantization off
and a float32 cache: greedy tokens equal (but at HF's own near-ties) and logprobs within 1e-4.

Each family's tiny random-weight model comes from transformers' own config class with the
family's features switched on: sliding windows shorter than the prompts (so that decodes attend
through them), soft-capping, q/k norms, per-layer rope tables, rope scaling (yarn, longrope,
linear, llama3), partial rotary. It runs mixed batches (prefill chunks beside decodes, a prefix
cached by another request), on the default backend (the CPU kernels where they apply, the
reference's ops where they do not) and on the torch reference.
"""

from __future__ import annotations

import random

import pytest
from gguf_files import write_gguf
from hf_parity import (
    BLOCK_SIZE,
    VOCAB,
    Driver,
    assert_all_match,
    hf_greedy,
    make_prompts,
    make_tiny_model,
    prefix_hits,
)
from worker_testlib import load_runner, one_torch_thread  # noqa: F401 (an autouse fixture)

WINDOW = 8  # shorter than most prompts (up to 40 tokens) and than every decode (48 more)

FAMILIES = {
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen3-qk-norm-window": (
        "qwen3",
        {
            "head_dim": 16,
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,  # layers 1 and 2 windowed, layer 0 global
        },
    ),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 16}),  # as llama.cpp runs it (in a GGUF too)
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 3.0,  # low enough to bend the random model's scores
            "final_logit_softcapping": 15.0,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3": (
        "gemma3",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            "tie_word_embeddings": True,
        },
    ),
    # longrope's table is chosen from the served context (pyserve/worker/rope.py, RotaryTable):
    # the long one with a served context past the original (prompts past it too, so that HF,
    # which switches per sequence, uses it throughout) ...
    "phi3-longrope-long-partial-window": (
        "phi3",
        {
            "sliding_window": WINDOW,
            "original_max_position_embeddings": 32,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0 + 0.5 * i for i in range(4)],
                "short_factor": [1.0 + 0.1 * i for i in range(4)],
            },
            "partial_rotary_factor": 0.5,
            "pad_token_id": 0,
        },
    ),
    # ... and the short one within it
    "phi3-longrope-short": (
        "phi3",
        {
            "original_max_position_embeddings": 256,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0 + 0.5 * i for i in range(8)],
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
            },
            "pad_token_id": 0,
        },
    ),
    "llama3-tied": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
}


# Mixtures of experts: 8 experts, top-2, so that a batch's tokens spread over most of them
MOE = {"num_experts_per_tok": 2}
MOE_FAMILIES = {
    # top-k renormalized, as Qwen3-MoE checkpoints are (and as llama.cpp runs every one)
    "qwen3moe": (
        "qwen3_moe",
        {
            **MOE,
            "head_dim": 16,
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    # a shared expert, softmax weights kept as they are, and a dense layer between sparse ones
    "qwen2moe-shared": (
        "qwen2_moe",
        {
            **MOE,
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": ("mixtral", {**MOE, "num_local_experts": 8, "intermediate_size": 32}),
    # q/k normalized over all heads at once
    "olmoe": ("olmoe", {**MOE, "num_experts": 8, "intermediate_size": 32}),
    # sinks, biases everywhere, softmax over the top-k logits, a clamped SwiGLU, windows on the
    # even layers, yarn with an unrounded ramp
    "gpt-oss-window": (
        "gpt_oss",
        {
            **MOE,
            "head_dim": 16,
            "num_local_experts": 8,
            "intermediate_size": 32,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        },
    ),
}
FAMILIES |= MOE_FAMILIES


# the served context of each family's runner: the model's own unless set
SERVED_CONTEXT = {"phi3-longrope-short": 256}


_BUILT: dict[str, tuple] = {}  # family name -> (name, directory, model, prompts, refs)


def built_family(name: str, tmp_path_factory) -> tuple:
    """The family's tiny model and HF's greedy references, built once per test session."""
    if name not in _BUILT:
        kind, overrides = FAMILIES[name]
        directory = tmp_path_factory.mktemp(name)
        model = make_tiny_model(directory, kind, seed=17, **overrides)
        prompts = make_prompts(seed=4)
        if "longrope-long" in name:  # past the original context from the first token
            rng = random.Random(8)
            prompts = [[rng.randrange(3, VOCAB) for _ in range(33)] + p for p in prompts]
        # HF picks longrope's table from the batch's longest sequence: one prompt at a time
        refs = hf_greedy(model, prompts, one_by_one=kind == "phi3")
        _BUILT[name] = (name, directory, model, prompts, refs)
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return built_family(request.param, tmp_path_factory)


def exact_runner(family, backend: str = "auto", **backend_options):
    name, directory, *_ = family
    return load_runner(
        str(directory), num_blocks=1024, block_size=BLOCK_SIZE, quantization="none",
        kv_cache_dtype="float32", backend=backend, max_model_len=SERVED_CONTEXT.get(name),
        backend_options=backend_options,
    )  # fmt: skip


# The Triton backend's kernels run in Triton's interpreter here (conftest.py), ~50 s a family on
# 2 cores: these three cover what its kernels do (GQA, q/k norms, windows, soft-capping, gelu,
# partial rotary dims), and a mixture of experts (its experts through the grouped-expert kernel).
TRITON_FAMILIES = [
    "qwen3-qk-norm-window",
    "gemma2",
    "phi3-longrope-long-partial-window",
    "qwen3moe",
    "gpt-oss-window",
]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mixed_batches_match_hf(family, backend):
    check_mixed_batches(family, backend)


@pytest.mark.parametrize("name", TRITON_FAMILIES)
def test_mixed_batches_match_hf_on_the_triton_backend(name, tmp_path_factory):
    check_mixed_batches(built_family(name, tmp_path_factory), "triton")


def check_mixed_batches(family, backend: str) -> None:
    name, _, _, prompts, refs = family
    runner = exact_runner(family, backend)
    features = runner.config.features()
    if "window" in name:
        assert any(f.startswith("sliding window") for f in features), features
    if backend == "triton" and runner.config.moe is not None:
        assert runner.backend.info().kernels["experts"] == "grouped on 3 of 3 layers"
    driver = Driver(runner)
    seqs = [driver.new_seq(p) for p in prompts]
    # the first half prefills, then decodes beside the second half's prefill chunks
    driver.step([(s, s.pending) for s in seqs[:4]])
    rng = random.Random(9)
    while any(s.computed < s.prompt_len for s in seqs[4:]):
        entries = [(s, 1) for s in seqs[:4]]
        for s in seqs[4:]:
            if s.computed < s.prompt_len:
                entries.append((s, rng.randint(1, s.pending)))
        driver.step(entries)
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


def test_speculative_verify_entries_match_hf(family):
    """Speculative decoding's verify entries (the newest token and drafts, every position
    scored, beside other requests' verifies), with HF's own continuation as drafts, some
    corrupted: the emitted tokens and their logprobs are HF's."""
    _, _, _, prompts, refs = family
    driver = Driver(exact_runner(family))
    seqs = [driver.new_seq(p) for p in prompts]
    driver.step([(s, s.pending) for s in seqs])
    driver.run_verifies(seqs, refs, random.Random(11))
    assert_all_match(seqs, refs)


def test_decode_graph_buffers_pad_decodes_and_verifies_without_changing_tokens(
    tmp_path_factory, monkeypatch
):
    """The Triton backend's decode-graph path (static buffers, padded batch sizes, a scratch
    block for the padding rows, the split count fixed by the model's context and each split's
    positions set per step) run eagerly, as a GPU replays it, over steps of decodes and verify
    entries (each drafted position a decode row of the graph): HF's tokens and logprobs, and
    verify rows went through the graphs."""
    from pyserve.worker.backends.triton import backend as triton_backend

    monkeypatch.setattr(triton_backend, "SPLIT_TOKENS", 128)  # 4 splits of the 512-token context
    family = built_family("qwen3-qk-norm-window", tmp_path_factory)
    _, _, _, prompts, refs = family
    runner = exact_runner(family, "triton", decode_graphs="eager", graph_max_batch=32)
    graphs = runner.backend.graphs
    assert graphs.meta.num_splits > 1
    extra_rows = []  # per step through the graphs: its rows beyond one an entry
    fill = graphs._fill

    def counted_fill(batch, size):
        extra_rows.append(len(batch.input_ids) - batch.num_entries)
        fill(batch, size)

    monkeypatch.setattr(graphs, "_fill", counted_fill)
    driver = Driver(runner)
    seqs = [driver.new_seq(p) for p in prompts[:3]]  # 3 decode rows: padded to a graph of 4
    driver.step([(s, s.pending) for s in seqs])
    driver.run_verifies(seqs, refs[:3], random.Random(5), max_drafts=8)
    assert_all_match(seqs, refs[:3])
    assert graphs.steps == len(extra_rows) and 0 in extra_rows and max(extra_rows) > 0


def test_the_triton_warm_up_writes_only_the_scratch_block(tmp_path_factory):
    """The start-up prefill + decode that compiles the kernels on a GPU (run here through the
    interpreter): K/V go to the block no request owns, the pool's blocks stay as they were."""
    import torch

    family = built_family("qwen3-qk-norm-window", tmp_path_factory)
    runner = exact_runner(family, "triton", decode_graphs="off")
    backend, cache = runner.backend, runner.backend.kv_cache
    scratch = backend._scratch_block
    assert cache.num_blocks == runner.num_blocks + 1 and scratch == runner.num_blocks
    before = [k.clone() for k in cache.k]
    backend.warm_up(runner.model)
    pool_slots = scratch * cache.block_size  # slot-major: the scratch block's slots come last
    for layer, k in enumerate(cache.k):
        assert torch.equal(k[:pool_slots], before[layer][:pool_slots])
        assert k[pool_slots:].abs().sum() > 0


def test_a_cached_prefix_gives_what_a_cold_prompt_gives(family):
    """A request whose first blocks another request wrote (a prefix-cache hit) matches HF."""
    _, _, _, prompts, refs = family
    runner = exact_runner(family)
    driver = Driver(runner)
    seqs = prefix_hits(driver, prompts, seed=3, decode=0)
    driver.step([(s, s.pending) for s in seqs])
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


# What llama.cpp's GGUF format cannot say: Qwen3's per-layer windows (llama.cpp runs Qwen3 with
# none, and so does a GGUF loaded here)
WINDOWS_NOT_IN_GGUF = {"qwen3-qk-norm-window"}


def without_windows(model):
    """The same weights in a transformers model whose layers all attend to everything."""
    import copy

    config = copy.deepcopy(model.config)
    config.use_sliding_window, config.sliding_window = False, None
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    plain = type(model)(config).eval()
    plain.load_state_dict(model.state_dict())
    return plain


def test_the_same_model_as_a_gguf_gives_the_same_output(family, tmp_path):
    """The family's model written as llama.cpp's converter writes it (its names, permutations and
    norm offsets) loads into the same model: HF's tokens and logprobs again. Where the format has
    no key for a feature (Qwen3's windows), the GGUF model is the one llama.cpp runs: HF's
    model without it."""
    name, _, model, prompts, refs = family
    path = tmp_path / f"{name}.gguf"
    write_gguf(model, path)
    runner = load_runner(
        str(path), num_blocks=1024, block_size=BLOCK_SIZE, quantization="none",
        kv_cache_dtype="float32", max_model_len=SERVED_CONTEXT.get(name),
    )  # fmt: skip
    from_hf = exact_runner(family).config
    windows = [layer.sliding_window for layer in runner.config.layers]
    if name in WINDOWS_NOT_IN_GGUF:
        assert windows == [None] * len(windows)
        refs = hf_greedy(without_windows(model), prompts)
    else:
        assert windows == [layer.sliding_window for layer in from_hf.layers]
    for field in ("qk_norm", "sandwich_norms", "activation", "attention_scale", "attn_softcap"):
        assert getattr(runner.config, field) == pytest.approx(getattr(from_hf, field)), field
    driver = Driver(runner)
    seqs = [driver.new_seq(p) for p in prompts]
    driver.step([(s, s.pending) for s in seqs])
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


def test_each_family_says_what_it_runs(family):
    name = family[0]
    runner = exact_runner(family)
    info = runner.backend.info()
    assert info.name in ("cpu-kernels", "torch") and info.reason
    expected = {
        "gemma2": ["sandwich norms", "activation gelu_tanh", "attention softcap 3.0"],
        "gemma3": ["q/k norm", "2 rope tables", "sandwich norms"],
        "qwen3": ["q/k norm"],
        "phi3": ["rope longrope"],
        "qwen2": ["rope yarn", "qkv bias"],
        "qwen3moe": ["q/k norm", "mixture of experts: top-2 of 8 on 3 layers"],
        "qwen2moe": ["qkv bias", "mixture of experts: top-2 of 8 + a shared expert on 2 layers"],
        "mixtral": ["mixture of experts: top-2 of 8 on 3 layers"],
        "olmoe": ["full-width q/k norm", "mixture of experts: top-2 of 8 on 3 layers"],
        "gpt": [
            "attention sinks",
            "qkv bias",
            "o bias",
            "rope yarn",
            "activation clamped_swiglu",
            "softmax over the top-k logits",
            "router bias",
            "expert biases",
            "sliding window 8 on 2 layers",
        ],
    }.get(name.split("-")[0], [])
    if "partial" in name:
        expected.append("partial rotary 8/16")
    if runner.config.attention_sinks and info.name == "cpu-kernels":  # the kernels have sinks
        assert info.kernels["attention"] == "kernels", info.kernels
    if runner.config.tie_word_embeddings:  # one matrix for the embedding and the head
        assert runner.model.lm_head.weight is runner.model.embed_tokens
    for feature in expected:
        assert feature in runner.config.features(), (feature, runner.config.features())


def test_an_unregistered_architecture_fails_naming_the_supported_ones(tmp_path):
    import json

    import transformers

    from pyserve.worker.loading import ModelLoadError

    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as raised:
        load_runner(str(tmp_path))
    message = str(raised.value)
    assert "architecture 'gpt2' is not supported" in message
    for name in ("gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3"):
        assert name in message
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
