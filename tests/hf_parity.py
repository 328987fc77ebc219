"""Hugging Face parity for the worker's models: tiny random-weight models, HF's greedy
references, and a small driver that plays the scheduler (blocks from a free list, hand-built
ForwardBatches, greedy argmax) so each situation the core produces can be checked against HF
``generate`` on the same weights. Where greedy tokens diverge, the divergence must be a near-tie
in HF's own logits, or the check fails."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

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
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    # eager attention: what every family's features run under (transformers 5.17 defaults
    # Gemma 2 to sdpa, which drops the attention soft-cap)
    config = config_cls(**{**TINY, **overrides}, attn_implementation="eager")
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


def hf_greedy(
    model, prompts: list[list[int]], steps: int = NEW_TOKENS, one_by_one: bool = False
) -> list[Reference]:
    """HF ``generate`` (greedy, float32) for all prompts in one left-padded batch, or for each
    prompt alone (``one_by_one``: where HF's result depends on the batch, as longrope's table
    does on the batch's longest sequence)."""
    if one_by_one:
        return [hf_greedy(model, [p], steps)[0] for p in prompts]
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

    def verify_step(self, entries: list[tuple[Seq, list[int]]]) -> None:
        """One step of verify entries, as speculative decoding runs them: each sequence's newest
        token and its drafts, every position scored; greedy acceptance keeps the drafts up to
        the first that is not the argmax, then that argmax (each emitted token's logprobs are
        its own position's)."""
        ids: list[int] = []
        positions: list[int] = []
        for seq, drafts in entries:
            start = seq.computed
            assert seq.pending == 1, "a verify entry starts at the sequence's newest token"
            n = 1 + len(drafts)
            while len(seq.table) * BLOCK_SIZE < start + n:
                seq.table.append(self.free.pop())
            ids += [seq.tokens[start], *drafts]
            positions += range(start, start + n)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            start_pos=[seq.computed for seq, _ in entries],
            num_tokens=[1 + len(d) for _, d in entries],
            block_tables=[list(seq.table) for seq, _ in entries],
            sample_index=torch.arange(len(ids)),
        )
        logits = self.runner.forward(batch)
        row = 0
        for seq, drafts in entries:
            for i in range(len(drafts) + 1):
                seq.logprobs.append(logits[row + i].log_softmax(-1))
                token = int(logits[row + i].argmax())
                seq.tokens.append(token)
                if i == len(drafts) or token != drafts[i]:
                    seq.computed += i + 1  # the K/V past the accepted drafts is rewritten later
                    break
            row += len(drafts) + 1

    def run_verifies(
        self, seqs: list[Seq], refs: list[Reference], rng: random.Random, max_drafts: int = 15
    ) -> None:
        """Decodes every sequence to NEW_TOKENS with verify entries whose drafts are HF's own
        continuation, cut short, or corrupted at a random place one time in three. Up to 15
        drafts: entries of up to 16 tokens, which the CPU kernels backend attends as decode
        rows."""
        while True:
            active = [s for s in seqs if len(s.generated) < NEW_TOKENS]
            if not active:
                return
            entries = []
            for seq in active:
                ref = refs[seqs.index(seq)].tokens
                done = len(seq.generated)
                k = rng.randint(0, min(max_drafts, NEW_TOKENS - done - 1))
                drafts = list(ref[done : done + k])
                if drafts and rng.random() < 1 / 3:
                    drafts[rng.randrange(len(drafts))] = rng.randrange(3, VOCAB)
                entries.append((seq, drafts))
            self.verify_step(entries)

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


def assert_all_match(seqs: list[Seq], refs: list[Reference]) -> None:
    compared = [check_against_hf(s, r) for s, r in zip(seqs, refs, strict=True)]
    # a test where everything diverges at once compares nothing: demand real coverage
    assert sum(compared) >= 0.9 * NEW_TOKENS * len(seqs), compared


def prefix_hits(driver: Driver, prompts: list[list[int]], seed: int, decode: int = 3) -> list[Seq]:
    """For each prompt, an earlier request writes its whole leading blocks (then goes its own
    way for 6 tokens and decodes ``decode``); the prompt then reuses them, as the prefix cache
    hands them out. Returns the prompts' sequences, their remaining tokens not yet run."""
    rng = random.Random(seed)
    seqs = []
    for prompt in prompts:
        shared = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        earlier = driver.new_seq(prompt[:shared] + [rng.randrange(3, VOCAB) for _ in range(6)])
        driver.step([(earlier, earlier.pending)])
        if decode:
            driver.run_decodes([earlier], steps=decode)
        seqs.append(driver.new_seq(prompt, prefix_from=earlier, cached=shared))
    return seqs
