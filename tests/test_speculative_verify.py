"""Speculative verification: exact against the Sampler run position by position, and exact in
distribution (fixed seeds, so every verdict is deterministic)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_sampling import EOS, VOCAB, Seq
from worker_testlib import one_torch_thread  # noqa: F401 (an autouse fixture)

from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker.sampling import Sampler, make_generator
from pyserve.worker.speculative_verify import DraftProposal, verify_drafts

# chi-square bound for the distribution tests: far above the 99.99th percentile for the few
# degrees of freedom used; the seeds are fixed, so the verdict never changes between runs
CHI2_BOUND = 40.0


def seq(output: list[int] | None = None, **params) -> Seq:
    params.setdefault("max_new_tokens", 100)
    p = SamplingParams(**params)
    return Seq(p, output_ids=list(output or []), generator=make_generator(p.seed, "cpu"))


def plain_decode(sampler: Sampler, logits: torch.Tensor, s: Seq, steps: int):
    """The Sampler one position at a time, each emitted token appended to the output."""
    tokens, logprobs = [], []
    state = Seq(s.params, s.prompt_ids, list(s.output_ids), s.generator)
    for i in range(steps):
        out = sampler(logits[i : i + 1].clone(), [state])
        tokens.append(out.token_ids[0])
        if out.logprobs is not None:
            logprobs.append(out.logprobs[0])
        state.output_ids.append(out.token_ids[0])
    return tokens, logprobs


PENALISED = dict(
    repetition_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=0.3,
    logit_bias={3: 2.5, 9: -1.0, 11: 4.0},
    min_tokens=3,
    logprobs=True,
)


@pytest.mark.parametrize("trial", range(40))
def test_greedy_emits_exactly_plain_greedy_tokens(trial: int) -> None:
    rng = random.Random(trial)
    gen = torch.Generator().manual_seed(trial)
    k = rng.randrange(0, 6)
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 3.0
    logits[:, EOS] += 4.0  # EOS likely: min_tokens must hold it back for the first positions
    s = seq(output=[7, 11, 7], temperature=0.0, **PENALISED)
    s.output_ids = [7] if trial % 2 else []  # min_tokens lifts inside the drafts or not
    expected, expected_logprobs = plain_decode(Sampler([EOS]), logits, s, k + 1)
    # drafts that follow plain greedy decoding for a while, then (maybe) go astray
    good = rng.randrange(0, k + 1)
    drafts = expected[:good] + [
        (t + 1 + rng.randrange(VOCAB - 1)) % VOCAB for t in expected[good:k]
    ]

    (out,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(s, drafts)])

    assert out.accepted == (good if good < k else k)
    assert out.token_ids == expected[: out.accepted + 1]
    assert out.logprobs == pytest.approx(expected_logprobs[: out.accepted + 1], abs=1e-6)


def test_greedy_with_draft_probabilities_accepts_only_the_argmax() -> None:
    gen = torch.Generator().manual_seed(7)
    k = 4
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 3.0
    s = seq(temperature=0.0, **PENALISED)
    expected, _ = plain_decode(Sampler([EOS]), logits, s, k + 1)
    drafts = [*expected[:2], (expected[2] + 1) % VOCAB, 0]
    q = torch.softmax(torch.randn(k, VOCAB, generator=gen), dim=-1)

    (out,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(s, drafts, q)])

    assert (out.accepted, out.token_ids) == (2, expected[:3])


@pytest.mark.parametrize("trial", range(30))
def test_seeded_ngram_drafts_emit_exactly_plain_seeded_tokens(trial: int) -> None:
    rng = random.Random(100 + trial)
    gen = torch.Generator().manual_seed(100 + trial)
    k = rng.randrange(0, 6)
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 1.5
    filters = [
        dict(top_k=8),
        dict(top_p=0.8),
        dict(min_p=0.1),
        dict(top_k=20, top_p=0.9, min_p=0.02),
        {},
    ][trial % 5]
    make = lambda: seq(temperature=0.8, seed=trial, **PENALISED, **filters)  # noqa: E731
    plain = make()
    expected, expected_logprobs = plain_decode(Sampler([EOS]), logits, plain, k + 1)
    good = rng.randrange(0, k + 1)
    drafts = expected[:good] + [rng.randrange(VOCAB) for _ in range(k - good)]
    s = make()

    (out,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(s, drafts)])

    n = out.accepted + 1
    assert out.accepted >= min(good, k)
    assert out.token_ids == expected[:n]
    assert out.token_ids[: out.accepted] == drafts[: out.accepted]
    assert out.logprobs == pytest.approx(expected_logprobs[:n], abs=1e-6)
    # the generator consumed one number per emitted token, as plain decoding does
    replay = make()
    plain_decode(Sampler([EOS]), logits, replay, n)
    assert s.generator is not None and replay.generator is not None
    assert torch.equal(
        torch.rand(4, generator=s.generator), torch.rand(4, generator=replay.generator)
    )


def test_seeded_draft_model_is_reproducible() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=gen)
    q = torch.softmax(torch.randn(4, VOCAB, generator=gen), dim=-1)
    drafts = [int(t) for t in q.argmax(dim=-1)]
    runs = [
        verify_drafts(
            Sampler([EOS]), logits, [DraftProposal(seq(temperature=1.0, seed=42), drafts, q)]
        )[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_a_batch_verifies_each_proposal_on_its_own_rows() -> None:
    gen = torch.Generator().manual_seed(11)
    ks = [3, 0, 2]
    logits = torch.randn(sum(ks) + len(ks), VOCAB, generator=gen) * 3.0
    seqs = [seq(temperature=0.0, **PENALISED) for _ in ks]
    alone, proposals, offset = [], [], 0
    for s, k in zip(seqs, ks, strict=True):
        rows = logits[offset : offset + k + 1]
        expected, _ = plain_decode(Sampler([EOS]), rows, s, k + 1)
        drafts = expected[:k]  # all correct: every proposal ends on its bonus token
        alone.append(verify_drafts(Sampler([EOS]), rows, [DraftProposal(s, drafts)])[0])
        proposals.append(DraftProposal(s, drafts))
        offset += k + 1
    together = verify_drafts(Sampler([EOS]), logits, proposals)
    assert together == alone
    assert [o.accepted for o in together] == ks


# ---- edge cases ----


def test_k0_is_one_plain_step() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    expected, _ = plain_decode(Sampler([EOS]), logits, seq(temperature=0.9, seed=5), 1)
    (out,) = verify_drafts(
        Sampler([EOS]), logits, [DraftProposal(seq(temperature=0.9, seed=5), [])]
    )
    assert (out.accepted, out.token_ids) == (0, expected)


def test_all_accepted_adds_the_bonus_token_and_first_rejected_emits_one() -> None:
    logits = torch.full((4, VOCAB), -5.0)
    for i, t in enumerate([10, 20, 30, 40]):
        logits[i, t] = 5.0
    s = seq(temperature=0.0)
    (all_in,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(s, [10, 20, 30])])
    assert (all_in.accepted, all_in.token_ids) == (3, [10, 20, 30, 40])
    (first_out,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(s, [11, 20, 30])])
    assert (first_out.accepted, first_out.token_ids) == (0, [10])
    assert first_out.logprobs is None


def test_eos_among_drafts_is_verified_like_any_token() -> None:
    logits = torch.full((3, VOCAB), -5.0)
    logits[0, EOS] = logits[1, 12] = logits[2, 13] = 5.0
    (out,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(seq(temperature=0.0), [EOS, 12])])
    assert out.token_ids == [EOS, 12, 13]  # the caller cuts after EOS


def test_min_tokens_lifts_within_the_drafts() -> None:
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, EOS] = 5.0
    logits[:, 4] = 4.0
    s = seq(output=[9], temperature=0.0, min_tokens=2)
    (out,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(s, [4, EOS])])
    # position 0 has one output token (EOS banned), position 1 two: EOS allowed
    assert (out.accepted, out.token_ids) == (2, [4, EOS, EOS])


@pytest.mark.parametrize("as_callback", [False, True])
def test_a_grammar_forbidden_draft_is_rejected_before_verification(as_callback: bool) -> None:
    logits = torch.full((4, VOCAB), -5.0)
    logits[:, 20] = 5.0
    logits[:, 21] = 4.0
    allowed = torch.ones(4, VOCAB, dtype=torch.bool)
    allowed[1, 20] = False  # the grammar forbids draft 1
    asked: list[int] = []

    def mask(i: int) -> torch.Tensor:
        asked.append(i)
        return allowed[i]

    s = seq(temperature=0.0)
    proposal = DraftProposal(s, [20, 20, 20], allowed=mask if as_callback else allowed)
    (out,) = verify_drafts(Sampler([EOS]), logits, [proposal])
    assert (out.accepted, out.token_ids) == (1, [20, 21])
    if as_callback:
        assert asked == [0, 1]  # positions past the forbidden draft are never asked for


def test_logprobs_and_top_logprobs_are_the_unmodified_ones() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, VOCAB, generator=gen)
    s = seq(temperature=0.0, top_logprobs=3, logit_bias={5: 50.0})
    (out,) = verify_drafts(Sampler([EOS]), logits, [DraftProposal(s, [5, 5])])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids == [5, 5, 5]
    assert out.logprobs == pytest.approx(raw[:, 5].tolist(), abs=1e-6)
    assert out.top_logprobs is not None
    for i, (ids, values) in enumerate(out.top_logprobs):
        top = raw[i].topk(3)
        assert ids == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-6)


def test_wrong_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        verify_drafts(Sampler([EOS]), torch.zeros(2, VOCAB), [DraftProposal(seq(), [1, 2])])
    with pytest.raises(ValueError):
        verify_drafts(
            Sampler([EOS]), torch.zeros(2, VOCAB), [DraftProposal(seq(), [1], torch.ones(2, 3))]
        )


# ---- distributions on a tiny vocabulary ----

TINY = 6
DRAWS = 12_000


def ref_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """temperature, min_p, top_k, top_p over what is left; float64, one entry at a time."""

    def softmax(xs: list[float]) -> list[float]:
        top = max(xs)
        exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in xs]
        return [e / sum(exps) for e in exps]

    xs = [x / params.temperature for x in logits]
    if params.min_p > 0:
        probs = softmax(xs)
        xs = [
            x if p >= params.min_p * max(probs) else -math.inf
            for x, p in zip(xs, probs, strict=True)
        ]
    if 0 < params.top_k < len(xs):
        kth = sorted(xs, reverse=True)[params.top_k - 1]
        xs = [x if x >= kth else -math.inf for x in xs]
    if params.top_p < 1.0:
        probs, mass = softmax(xs), 0.0
        for token in sorted(range(len(xs)), key=lambda t: -probs[t]):
            if mass >= params.top_p and probs[token] < max(probs):
                xs[token] = -math.inf
            mass += probs[token]
    return softmax(xs)


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    stat = 0.0
    for c, p in zip(counts, probs, strict=True):
        if p == 0.0:
            assert c == 0, "a token of probability 0 was emitted"
        else:
            stat += (c - total * p) ** 2 / (total * p)
    return stat


TINY_LOGITS = [2.0, 1.6, 1.1, 0.4, -0.3, -1.0]
FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.85),
    dict(temperature=0.9, min_p=0.12),
    dict(temperature=1.1, top_k=5, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_first_emitted_token_follows_the_target(filters: dict, drafter: str) -> None:
    k = 2
    params = SamplingParams(max_new_tokens=10, **filters)
    p0 = ref_probs(TINY_LOGITS, params)
    logits = torch.tensor([TINY_LOGITS] * (k + 1)).repeat(DRAWS, 1)
    draft_gen = torch.Generator().manual_seed(2024)
    # the draft model disagrees on purpose: it favours the target's least likely tokens
    q = torch.softmax(torch.tensor(TINY_LOGITS[::-1]) * 0.8, dim=-1).expand(k, TINY)
    proposals = []
    for _ in range(DRAWS):
        drafts = torch.multinomial(q, 1, generator=draft_gen).squeeze(1).tolist()
        s = Seq(params)
        proposals.append(DraftProposal(s, drafts, q if drafter == "model" else None))

    outs = verify_drafts(Sampler([EOS], seed=77), logits, proposals)

    counts = [0] * TINY
    for out in outs:
        counts[out.token_ids[0]] += 1
    assert chi_square(counts, p0) < CHI2_BOUND, (counts, p0)


def test_accepted_count_follows_min_p_q() -> None:
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.10, 0.30, 0.05, 0.35, 0.15, 0.05], dtype=torch.float64)
    alpha = float(torch.minimum(p, q).sum())  # P(accept) per position
    k = 3
    logits = p.log().float().expand(DRAWS * (k + 1), TINY).clone()
    draft_gen = torch.Generator().manual_seed(5)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    q_rows = q.float().expand(k, TINY)
    proposals = [
        DraftProposal(
            Seq(params),
            torch.multinomial(q_rows, 1, generator=draft_gen).squeeze(1).tolist(),
            q_rows,
        )
        for _ in range(DRAWS)
    ]

    outs = verify_drafts(Sampler([EOS], seed=8), logits, proposals)

    counts = [0] * (k + 1)
    for out in outs:
        counts[out.accepted] += 1
        assert len(out.token_ids) == out.accepted + 1
    expected = [alpha**a * (1 - alpha) for a in range(k)] + [alpha**k]
    assert chi_square(counts, expected) < CHI2_BOUND, (counts, expected)
    mean = sum(a * c for a, c in enumerate(counts)) / DRAWS
    assert mean == pytest.approx(sum(a * e for a, e in enumerate(expected)), abs=0.05)
    # with k = 1 the mean accepted count is sum(min(p, q)) itself
    first = sum(1 for out in outs if out.accepted >= 1) / DRAWS
    assert first == pytest.approx(alpha, abs=0.02)


def test_ngram_rejection_is_the_target_without_the_draft() -> None:
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=5)
    p0 = ref_probs(TINY_LOGITS, params)
    draft = 0  # the most likely token: rejected often enough to test the corrections
    logits = torch.tensor([TINY_LOGITS] * 2).repeat(DRAWS, 1)
    outs = verify_drafts(
        Sampler([EOS], seed=13), logits, [DraftProposal(Seq(params), [draft]) for _ in range(DRAWS)]
    )
    accepted = sum(out.accepted for out in outs)
    assert accepted / DRAWS == pytest.approx(p0[draft], abs=0.02)
    counts = [0] * TINY
    for out in outs:
        if out.accepted == 0:
            counts[out.token_ids[0]] += 1
    rest = [0.0 if t == draft else x / (1 - p0[draft]) for t, x in enumerate(p0)]
    assert chi_square(counts, rest) < CHI2_BOUND, (counts, rest)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone() -> None:
    gen = torch.Generator().manual_seed(21)
    q = torch.softmax(torch.randn(3, VOCAB, generator=gen), dim=-1)
    logits = torch.randn(4, VOCAB, generator=gen)
    drafts = [int(t) for t in logits[:3].argmax(dim=-1)]
    makers = [
        lambda: DraftProposal(seq(temperature=0.0, **PENALISED), drafts),
        lambda: DraftProposal(seq(temperature=0.7, seed=1, top_p=0.9, **PENALISED), drafts),
        lambda: DraftProposal(seq(temperature=1.0, seed=2, top_k=10), drafts, q),
    ]
    alone = [verify_drafts(Sampler([EOS]), logits, [make()])[0] for make in makers]
    together = verify_drafts(Sampler([EOS]), logits.repeat(3, 1), [make() for make in makers])
    assert together == alone
