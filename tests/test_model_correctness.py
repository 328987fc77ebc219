"""The worker's model against Hugging Face transformers: greedy tokens and logprobs, float32.

Tiny random-weight models are created here and saved with ``save_pretrained``; a small driver
plays the scheduler (blocks from a free list, hand-built ForwardBatches, greedy argmax) so each
situation the core produces — a request alone, mixed prefill + decode batches, prefix-cache hits,
chunked prefill — is checked against HF ``generate`` on the same weights. Where greedy tokens
diverge, the divergence must be a near-tie in HF's own logits, or the test fails.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from worker_testlib import one_torch_thread, paged_batch  # noqa: F401 (an autouse fixture)

from pyserve.worker.batch import ForwardBatch
from pyserve.worker.model_runner import ModelRunner

NEW_TOKENS = 48
NUM_PROMPTS = 8
BLOCK_SIZE = 4  # small, so that prompts span many blocks and chunks cut blocks in odd places
LOGPROB_TOL = 1e-4
NEAR_TIE = 1e-3
VOCAB = 512

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_model(directory, kind: str = "llama", seed: int = 0, **overrides):
    """Saves a random-weight model of ``kind`` into ``directory``; returns the HF model (fp32)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    model = model_cls(config).float().eval()
    with torch.no_grad():
        # Default init gives near-uniform logits (every argmax a near-tie) and attention that
        # barely depends on content; larger weights make both decisive.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias") or "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
    model.save_pretrained(directory)
    return model


@dataclass
class Reference:
    tokens: list[int]  # HF greedy continuation
    logprobs: torch.Tensor  # [steps, vocab], HF log_softmax at each step


def hf_greedy(model, prompts: list[list[int]], steps: int = NEW_TOKENS) -> list[Reference]:
    """HF ``generate`` (greedy, float32) for all prompts in one left-padded batch."""
    from transformers import GenerationConfig

    # no EOS: the reference runs the full length without suppressing any token
    model.generation_config.eos_token_id = None
    greedy = GenerationConfig(
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, generation_config=greedy)
    assert out.sequences.shape[1] == width + steps
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [prompts, steps, vocab]
    return [Reference(out.sequences[i, width:].tolist(), logprobs[i]) for i in range(len(prompts))]


def make_prompts(seed: int, count: int = NUM_PROMPTS) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 12, 17, 23, 31, 40, 9, 26, 3][:count]
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------------------- a tiny scheduler


@dataclass
class Seq:
    tokens: list[int]  # prompt + generated
    prompt_len: int
    table: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache
    logprobs: list[torch.Tensor] = field(default_factory=list)  # one row per sampled token

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed


class Driver:
    """Hands out blocks from a free list and runs entries (seq, n tokens) as one ForwardBatch."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(7).shuffle(self.free)  # tables that are not 0, 1, 2, ...

    def new_seq(self, prompt: list[int], prefix_from: Seq | None = None, cached: int = 0) -> Seq:
        """With ``prefix_from``, reuse its first ``cached`` tokens' blocks (a prefix-cache hit)."""
        seq = Seq(tokens=list(prompt), prompt_len=len(prompt))
        if prefix_from is not None:
            assert cached % BLOCK_SIZE == 0 and prefix_from.tokens[:cached] == prompt[:cached]
            seq.table = prefix_from.table[: cached // BLOCK_SIZE]
            seq.computed = cached
        return seq

    def step(self, entries: list[tuple[Seq, int]]) -> None:
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Seq] = []
        for seq, n in entries:
            start = seq.computed
            assert 1 <= n <= seq.pending
            while len(seq.table) * BLOCK_SIZE < start + n:
                seq.table.append(self.free.pop())
            ids += seq.tokens[start : start + n]
            positions += range(start, start + n)
            if start + n == len(seq.tokens):  # reached the newest token: sample the next one
                sample_rows.append(len(ids) - 1)
                samplers.append(seq)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            start_pos=[seq.computed for seq, _ in entries],
            num_tokens=[n for _, n in entries],
            block_tables=[list(seq.table) for seq, _ in entries],
            sample_index=torch.tensor(sample_rows, dtype=torch.int64),
        )
        logits = self.runner.forward(batch)
        assert logits.dtype == torch.float32
        assert logits.shape == (len(samplers), self.runner.config.vocab_size)
        for seq, n in entries:
            seq.computed += n
        for seq, row in zip(samplers, logits, strict=True):
            seq.logprobs.append(row.log_softmax(-1))
            seq.tokens.append(int(row.argmax()))

    def run_decodes(self, seqs: list[Seq], steps: int = NEW_TOKENS) -> None:
        """Decodes every sequence (all together) until each has ``steps`` new tokens."""
        while True:
            active = [s for s in seqs if len(s.generated) < steps]
            if not active:
                return
            self.step([(s, 1) for s in active])


def check_against_hf(seq: Seq, ref: Reference, steps: int = NEW_TOKENS) -> int:
    """Asserts tokens equal HF's up to a near-tie divergence; returns the tokens compared."""
    ours = seq.generated[:steps]
    assert len(ours) == steps
    for t, (mine, theirs) in enumerate(zip(ours, ref.tokens, strict=True)):
        diff = (seq.logprobs[t] - ref.logprobs[t]).abs().max().item()
        assert diff < LOGPROB_TOL, f"step {t}: logprobs differ from HF's by {diff:.2e}"
        if mine != theirs:
            top2 = ref.logprobs[t].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < NEAR_TIE, (
                f"step {t}: token {mine} != HF's {theirs}, and HF's top-2 gap {gap:.2e} "
                "is not a near-tie: a real bug"
            )
            return t
    return steps


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_model(directory, "llama")
    prompts = make_prompts(seed=1)
    refs = hf_greedy(model, prompts)
    runner = ModelRunner(str(directory), num_blocks=1024, block_size=BLOCK_SIZE)
    return runner, prompts, refs


def assert_all_match(seqs: list[Seq], refs: list[Reference]) -> None:
    compared = [check_against_hf(s, r) for s, r in zip(seqs, refs, strict=True)]
    # a test where everything diverges at once compares nothing: demand real coverage
    assert sum(compared) >= 0.9 * NEW_TOKENS * len(seqs), compared


def test_references_are_decisive(llama):
    """The tiny model's greedy choices are not near-ties, and its output is not one token."""
    _, _, refs = llama
    gaps = torch.cat([r.logprobs.topk(2, dim=-1).values.diff(dim=-1).neg() for r in refs])
    assert (gaps < NEAR_TIE).float().mean() < 0.02
    for ref in refs:
        assert len(set(ref.tokens)) >= 4, ref.tokens


def test_alone(llama):
    runner, prompts, refs = llama
    driver = Driver(runner)
    for prompt, ref in zip(prompts, refs, strict=True):
        seq = driver.new_seq(prompt)
        driver.step([(seq, len(prompt))])
        driver.run_decodes([seq])
        assert_all_match([seq], [ref])


def test_batched_mixed_prefill_and_decode(llama):
    """Request i is admitted at step i, so each forward mixes one prefill with i decodes."""
    runner, prompts, refs = llama
    driver = Driver(runner)
    seqs: list[Seq] = []
    for prompt in prompts:
        decodes = [(s, 1) for s in seqs]
        seqs.append(driver.new_seq(prompt))
        driver.step([*decodes[:2], (seqs[-1], len(prompt)), *decodes[2:]])
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


def test_prefix_cache_hit(llama):
    """A request reuses blocks an earlier request wrote for the same leading tokens."""
    runner, prompts, refs = llama
    driver = Driver(runner)
    rng = random.Random(3)
    seqs = []
    for prompt in prompts:
        # the earlier request shares whole blocks of this prompt, then goes its own way
        shared = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        earlier = driver.new_seq(prompt[:shared] + [rng.randrange(3, VOCAB) for _ in range(6)])
        driver.step([(earlier, earlier.pending)])
        driver.run_decodes([earlier], steps=3)
        seqs.append(driver.new_seq(prompt, prefix_from=earlier, cached=shared))
    # all the hits prefill in one forward, then decode together
    driver.step([(s, s.pending) for s in seqs])
    assert any(s.prompt_len - (s.prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE > 1 for s in seqs)
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


def test_chunked_prefill(llama):
    """Prompts cut at random points, chunks of several requests interleaved with decodes."""
    runner, prompts, refs = llama
    driver = Driver(runner)
    rng = random.Random(5)
    seqs = [driver.new_seq(p) for p in prompts]
    while any(len(s.generated) < NEW_TOKENS for s in seqs):
        entries = []
        for seq in seqs:
            if len(seq.generated) >= NEW_TOKENS or rng.random() < 0.3:
                continue  # not scheduled this step
            prefilling = seq.computed < seq.prompt_len
            n = rng.randint(1, seq.pending) if prefilling else 1
            entries.append((seq, n))
        if entries:
            rng.shuffle(entries)
            driver.step(entries)
    assert_all_match(seqs, refs)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("qwen2", {}),
        ("mistral", {"sliding_window": 4096}),
        (
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
    ],
    ids=["qwen2-bias", "mistral", "llama3-rope-tied"],
)
def test_variants_batched(tmp_path, kind, overrides):
    model = make_tiny_model(tmp_path, kind, seed=11, **overrides)
    runner = ModelRunner(str(tmp_path), num_blocks=512, block_size=BLOCK_SIZE)
    if kind == "qwen2":
        assert runner.config.qkv_bias
    if overrides.get("tie_word_embeddings"):
        assert runner.model.lm_head.weight is runner.model.embed_tokens
    prompts = make_prompts(seed=2)
    refs = hf_greedy(model, prompts)
    driver = Driver(runner)
    seqs = [driver.new_seq(p) for p in prompts]
    driver.step([(s, s.pending) for s in seqs[:4]])
    driver.step([(s, 1) for s in seqs[:4]] + [(s, s.pending) for s in seqs[4:]])
    driver.run_decodes(seqs)
    assert_all_match(seqs, refs)


# ---------------------------------------------------------------------------- attention alone


def dense_attention(q, keys, values, start: int) -> torch.Tensor:
    """Reference: q [n, H, D] at positions start.., keys/values [start + n, KVH, D]."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = q.transpose(0, 1).float() @ k.transpose(1, 2) * dim**-0.5  # [H, n, L]
    allowed = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("decode_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize(
    "dtype, max_chunk_tokens, tol",
    [(torch.float32, None, 1e-5), (torch.float32, 8, 1e-5), (torch.bfloat16, 12, 3e-2)],
    ids=["fp32-one-chunk", "fp32-split-chunks", "bf16-split-chunks"],
)
def test_attention_backend_matches_dense(dtype, max_chunk_tokens, tol, decode_kernel):
    """Mixed batch: fresh prefills, prefills after a prefix, 1-token chunks, long decodes."""
    from pyserve.worker.attention.cpu import CpuAttentionBackend
    from pyserve.worker.kv_cache import PagedKVCache

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 6, 2, 16, 4
    cache = PagedKVCache(
        num_layers=2, num_blocks=200, block_size=block, num_kv_heads=kv_heads, head_dim=dim,
        dtype=dtype,
    )  # fmt: skip
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    backend = CpuAttentionBackend(
        cache,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        max_chunk_tokens=max_chunk_tokens,  # the torch path's chunks; the kernel splits its own
        decode_kernel=decode_kernel,
    )
    assert backend.decode_kernel == decode_kernel
    # (start_pos, num_tokens) per entry
    shapes = [(37, 1), (0, 9), (12, 7), (5, 1), (0, 1), (61, 1), (23, 3), (2, 1)]
    tables, batch = paged_batch(shapes, block, 200, gen)
    total = batch.input_ids.numel()
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    # what the cache holds before the forward, per entry (its cached prefix)
    prefixes = []
    for (s, _), table in zip(shapes, tables, strict=True):
        keys, values = cache.gather(1, torch.tensor(table))
        prefixes.append((keys.flatten(1, 2)[:, :s], values.flatten(1, 2)[:, :s]))
    out = backend.forward(1, q, k, v, backend.prepare(batch))
    assert out.shape == q.shape and out.dtype == dtype
    row = 0
    for (s, n), (pk, pv) in zip(shapes, prefixes, strict=True):
        keys = torch.cat([pk.transpose(0, 1), k[row : row + n]])
        values = torch.cat([pv.transpose(0, 1), v[row : row + n]])
        expected = dense_attention(q[row : row + n], keys, values, s)
        err = (out[row : row + n].float() - expected).abs().max().item()
        assert err < tol, f"entry start={s} n={n}: error {err:.2e}"
        row += n
    assert (cache.k[0] != 0).all(), "layer 0 must be untouched"  # random init has no zeros


def test_decode_split_across_chunks_matches_hf(llama):
    """The torch split-softmax decode path (contexts spanning several chunks) against HF."""
    runner, prompts, refs = llama
    default, kernel = runner.attention.max_chunk_blocks, runner.attention.decode_kernel
    runner.attention.max_chunk_blocks = 3  # 12-token chunks: every context spans several
    runner.attention.decode_kernel = False  # the kernel (the default) splits contexts its own way
    try:
        driver = Driver(runner)
        seqs = [driver.new_seq(p) for p in prompts]
        driver.step([(s, s.pending) for s in seqs])
        driver.run_decodes(seqs)
    finally:
        runner.attention.max_chunk_blocks = default
        runner.attention.decode_kernel = kernel
    assert_all_match(seqs, refs)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.5},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_frequencies_match_transformers(tmp_path, scaling):
    """Inverse frequencies read from config.json equal transformers' for each rope type."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pyserve.model_files import resolve_model
    from pyserve.worker.loading.hf import read_hf_config
    from pyserve.worker.rope import inverse_frequencies

    overrides = {"rope_scaling": scaling} if scaling else {}
    hf_config = transformers.LlamaConfig(**{**TINY, "rope_theta": 50000.0, **overrides})
    hf_config.save_pretrained(tmp_path)
    ours = inverse_frequencies(read_hf_config(resolve_model(str(tmp_path))))
    if scaling is None:
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
        theirs = rotary.inv_freq
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    assert torch.equal(ours, theirs.float())
