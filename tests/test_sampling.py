"""Batched sampling against a plain per-request reference (issue 3, §4)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from worker_testlib import one_torch_thread  # noqa: F401 (an autouse fixture)

from pyserve.wire.main_to_worker import InvalidSampling, SamplingParams, check_sampling
from pyserve.worker.sampling import (
    Sampler,
    apply_min_p,
    apply_penalties,
    make_generator,
    top_k_top_p,
)

VOCAB = 64
EOS = 2


@dataclass
class Seq:
    params: SamplingParams
    prompt_ids: torch.Tensor = field(default_factory=lambda: torch.tensor([5, 6, 7]))
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def seq(prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Seq:
    params.setdefault("max_new_tokens", 100)
    p = SamplingParams(**params)
    return Seq(
        params=p,
        prompt_ids=torch.tensor(prompt if prompt is not None else [5, 6, 7]),
        output_ids=list(output or []),
        generator=make_generator(p.seed, "cpu"),
    )


# ---- the reference: one request at a time, one vocab entry at a time, in float64 ----


def ref_penalised(logits: list[float], s: Seq) -> list[float]:
    p = s.params
    seen = set(s.prompt_ids.tolist()) | set(s.output_ids)
    counts = Counter(s.output_ids)
    out = []
    for token, x in enumerate(logits):
        if token in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[token]
        x -= p.presence_penalty * (1 if counts[token] else 0)
        out.append(x)
    return out


def ref_softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def ref_filtered_probs(logits: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """min_p, then top_k, then top_p over what is left; returns the final distribution."""
    xs = list(logits)
    probs = ref_softmax(xs)
    if min_p > 0:
        best = max(probs)
        xs = [x if p >= min_p * best else -math.inf for x, p in zip(xs, probs, strict=True)]
    if 0 < top_k < len(xs):
        kth = sorted(xs, reverse=True)[top_k - 1]
        xs = [x if x >= kth else -math.inf for x in xs]
    if top_p < 1.0:
        probs = ref_softmax(xs)
        mass = 0.0
        for token in sorted(range(len(xs)), key=lambda t: -probs[t]):
            if mass >= top_p and probs[token] < max(probs):
                xs[token] = -math.inf
            mass += probs[token]
    return ref_softmax(xs)


def ref_final_probs(logits: list[float], s: Seq) -> list[float]:
    p = s.params
    xs = list(logits)
    if len(s.output_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
            xs[t] = -math.inf
    xs = ref_penalised(xs, s)
    xs = [x / p.temperature for x in xs]
    return ref_filtered_probs(xs, p.top_k, p.top_p, p.min_p)


def random_logits(rows: int, gen: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=gen) * scale


# ---- tests ----


def test_greedy_is_argmax_and_reports_raw_logprobs() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = random_logits(6, gen)
    seqs = [seq(temperature=0.0, logprobs=i % 2 == 0, top_logprobs=i) for i in range(6)]
    out = Sampler([EOS])(logits.clone(), seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    raw = torch.log_softmax(logits.double(), -1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-5)
        top = out.top_logprobs[row]
        if row == 0:
            assert top is None
            continue
        want = raw[row].topk(row)
        assert top[0] == want.indices.tolist()
        assert top[1] == pytest.approx(want.values.tolist(), abs=1e-5)


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = random_logits(6, gen)
    seqs = [
        seq(temperature=0.0),
        seq(temperature=1.0),
        seq(temperature=0.0, min_p=0.5, top_k=3),  # filters do not touch greedy rows
        seq(temperature=1.5, top_k=1),  # one candidate: a draw that must be the argmax
        seq(temperature=0.8, top_p=1e-6, seed=9),  # likewise through top_p
        seq(temperature=0.0),
    ]
    out = Sampler([EOS])(logits.clone(), seqs)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 3, 4, 5)] == [argmax[i] for i in (0, 2, 3, 4, 5)]


def test_no_logprobs_when_nobody_asks() -> None:
    out = Sampler([EOS])(torch.randn(3, VOCAB), [seq(temperature=0.0) for _ in range(3)])
    assert out.logprobs is None and out.top_logprobs is None


def test_logprobs_are_from_unmodified_logits_even_with_penalties_and_temperature() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = random_logits(4, gen)
    seqs = [
        seq(
            output=[1, 3, 3],
            temperature=0.5,
            repetition_penalty=1.8,
            logprobs=True,
            top_logprobs=3,
            seed=i,
        )
        for i in range(4)
    ]
    out = Sampler([EOS])(logits.clone(), seqs)
    raw = torch.log_softmax(logits, -1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert out.top_logprobs[row][0] == raw[row].topk(3).indices.tolist()


def filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]):
    """The sampler's filters, as dense float64 distributions."""
    if any(m > 0 for m in min_p):
        logits = apply_min_p(logits, min_p)
    ids, probs = top_k_top_p(logits, top_k=top_k, top_p=top_p)
    return torch.zeros(logits.shape, dtype=torch.float64).scatter_(1, ids, probs.double())


@pytest.mark.parametrize("case", range(40))
def test_filters_match_reference(case: int) -> None:
    rng = random.Random(case)
    gen = torch.Generator().manual_seed(case)
    rows = 8
    logits = random_logits(rows, gen, scale=rng.choice([0.5, 2.0, 5.0]))
    top_k = [rng.choice([0, 0, 1, 3, 10, 63, 64, 100]) for _ in range(rows)]
    top_p = [rng.choice([1.0, 0.05, 0.5, 0.9, 0.99]) for _ in range(rows)]
    min_p = [rng.choice([0.0, 0.0, 0.01, 0.2, 0.9]) for _ in range(rows)]
    got = filtered_probs(logits.clone(), top_k, top_p, min_p)
    for row in range(rows):
        want = ref_filtered_probs(logits[row].double().tolist(), top_k[row], top_p[row], min_p[row])
        kept = [t for t, p in enumerate(want) if p > 0]
        assert (got[row] > 0).nonzero().flatten().tolist() == kept, (
            top_k[row],
            top_p[row],
            min_p[row],
        )
        assert got[row].tolist() == pytest.approx(want, abs=1e-6)


def test_top_p_window_widens_for_flat_distributions() -> None:
    # a flat row keeps thousands of tokens: more than any first window of candidates
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 3000, generator=gen) * torch.tensor([[0.05], [1.0], [4.0]])
    top_p = [0.95, 0.9, 0.5]
    got = filtered_probs(logits.clone(), [0, 0, 0], top_p, [0.0] * 3)
    for row in range(3):
        want = ref_filtered_probs(logits[row].double().tolist(), 0, top_p[row], 0.0)
        assert (got[row] > 0).nonzero().flatten().tolist() == [
            t for t, p in enumerate(want) if p > 0
        ]
        assert got[row].tolist() == pytest.approx(want, abs=1e-7)
    assert (got[0] > 0).sum() > 2000


@pytest.mark.parametrize("case", range(20))
def test_penalties_match_reference(case: int) -> None:
    rng = random.Random(100 + case)
    gen = torch.Generator().manual_seed(100 + case)
    rows = 6
    logits = random_logits(rows, gen)
    seqs = [
        seq(
            prompt=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
            output=[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))],
            repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.5, -0.4, 2.0]),
            presence_penalty=rng.choice([0.0, 0.6, -1.0]),
        )
        for _ in range(rows)
    ]
    got = apply_penalties(logits.clone(), seqs)
    for row, s in enumerate(seqs):
        want = ref_penalised(logits[row].double().tolist(), s)
        assert got[row].tolist() == pytest.approx(want, abs=1e-5)


def test_repetition_penalty_counts_prompt_but_frequency_and_presence_only_output() -> None:
    logits = torch.full((1, VOCAB), 2.0)
    s = seq(
        prompt=[10],
        output=[20, 20],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    got = apply_penalties(logits, [s])[0]
    assert got[10].item() == pytest.approx(1.0)  # prompt token: repetition only
    assert got[20].item() == pytest.approx(1.0 - 2 * 0.5 - 0.25)  # output token: all three
    assert got[30].item() == pytest.approx(2.0)  # unseen


def test_greedy_with_penalties_takes_argmax_of_penalised_logits() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = random_logits(5, gen)
    seqs = [
        seq(output=logits[i].topk(3).indices.tolist(), temperature=0.0, presence_penalty=4.0)
        for i in range(5)
    ]
    out = Sampler([EOS])(logits.clone(), seqs)
    for row, s in enumerate(seqs):
        want = ref_penalised(logits[row].double().tolist(), s)
        assert out.token_ids[row] == max(range(VOCAB), key=lambda t: want[t])


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 9] = 9.0
    logits[:, 11] = 8.0
    seqs = [
        seq(output=[1], temperature=0.0, min_tokens=3, stop_token_ids=[9]),  # bans 2 and 9
        seq(output=[1, 1, 1], temperature=0.0, min_tokens=3, stop_token_ids=[9]),  # reached
        seq(output=[1], temperature=0.0, min_tokens=3, ignore_eos=True),  # EOS not a stop
        seq(output=[1], temperature=1.0, min_tokens=3, stop_token_ids=[9], seed=3),
    ]
    out = Sampler([EOS])(logits.clone(), seqs)
    assert out.token_ids[:3] == [11, EOS, EOS]
    assert out.token_ids[3] not in (EOS, 9)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.9, min_p=0.1),
        dict(
            temperature=1.0,
            top_k=8,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.5,
            frequency_penalty=0.3,
        ),
    ],
)
def test_draws_follow_the_reference_distribution(params: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    row = random_logits(1, gen, scale=1.5)[0]
    draws = 6000
    seqs = [seq(output=[3, 4, 4], **params) for _ in range(draws)]
    out = Sampler([EOS], seed=5)(row.expand(draws, VOCAB).clone(), seqs)
    want = ref_final_probs(row.double().tolist(), seqs[0])
    counts = Counter(out.token_ids)
    assert all(want[t] > 0 for t in counts), "a filtered-out token was drawn"
    for token in range(VOCAB):
        # 5 standard deviations of a binomial count, plus a little slack for tiny probabilities
        sd = math.sqrt(draws * want[token] * (1 - want[token]))
        assert abs(counts[token] - draws * want[token]) <= 5 * sd + 3, token


def _run_steps(
    sampler: Sampler, target: Seq, companions: list[Seq], position: int, steps: int
) -> list[int]:
    """Samples ``steps`` tokens for ``target`` with its logits a function of its own history."""
    tokens = []
    gen = torch.Generator().manual_seed(99)
    for _ in range(steps):
        hist = torch.Generator().manual_seed(len(target.output_ids) * 7919 + sum(target.output_ids))
        own = torch.randn(VOCAB, generator=hist)
        others = torch.randn(len(companions), VOCAB, generator=gen) * 3
        rows = [*others[:position], own, *others[position:]]
        batch = [*companions[:position], target, *companions[position:]]
        out = sampler(torch.stack(rows), batch)
        token = out.token_ids[position]
        target.output_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_output_does_not_depend_on_the_batch() -> None:
    def target(seed: int) -> Seq:
        return seq(temperature=1.0, top_p=0.95, seed=seed)

    alone = _run_steps(Sampler([EOS]), target(1234), [], 0, 24)
    for position, companions in [
        (0, [seq(temperature=0.8) for _ in range(5)]),
        (3, [seq(temperature=1.0, seed=s) for s in range(6)]),
        (2, [seq(temperature=0.0), seq(temperature=0.5, top_k=3, seed=1234), seq(temperature=2.0)]),
    ]:
        assert _run_steps(Sampler([EOS]), target(1234), companions, position, 24) == alone
    assert _run_steps(Sampler([EOS]), target(4321), [], 0, 24) != alone


def test_unseeded_requests_differ_between_samplers() -> None:
    logits = torch.zeros(32, VOCAB)
    a = Sampler([EOS])(logits.clone(), [seq(temperature=1.0) for _ in range(32)]).token_ids
    b = Sampler([EOS])(logits.clone(), [seq(temperature=1.0) for _ in range(32)]).token_ids
    assert a != b


def test_mismatched_rows_raise() -> None:
    with pytest.raises(ValueError):
        Sampler([EOS])(torch.zeros(2, VOCAB), [seq()])


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(frequency_penalty=float("-inf")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(min_p=-0.1),
        dict(repetition_penalty=0.0),
        dict(max_new_tokens=0),
        dict(top_logprobs=-1),
        dict(top_logprobs=21),
        dict(repetition_penalty=11.0),
        dict(logit_bias={5: 101.0}),
        dict(logit_bias={-1: 1.0}),
        dict(stop_token_ids=list(range(65))),
    ],
)
def test_check_sampling_rejects_nonsense_naming_the_field(bad: dict) -> None:
    bad.setdefault("max_new_tokens", 4)
    with pytest.raises(InvalidSampling) as caught:
        check_sampling(SamplingParams(**bad))
    assert caught.value.param in bad
    assert str(caught.value).startswith(f"{caught.value.param}: expected")


def test_logit_bias_of_minus_100_bans_the_top_token_and_plus_100_forces_another() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 5.0  # every row's favourite
    rows = [
        seq(temperature=0.0),
        seq(temperature=0.0, logit_bias={9: -100.0}),
        seq(temperature=1.0, seed=3, logit_bias={17: 100.0}),
    ]
    out = Sampler([EOS])(logits, rows)
    assert out.token_ids[0] == 9
    assert out.token_ids[1] != 9
    assert out.token_ids[2] == 17


def test_logit_bias_shifts_the_sampled_distribution_by_exp_of_the_bias() -> None:
    rows = [seq(temperature=1.0, logit_bias={3: math.log(3.0)}) for _ in range(4000)]
    logits = torch.full((len(rows), VOCAB), -1e9)
    logits[:, 3] = logits[:, 4] = 0.0  # equal odds before the bias, 3:1 after it
    counts = Counter(Sampler([EOS], seed=0)(logits, rows).token_ids)
    assert set(counts) == {3, 4}
    assert 0.72 < counts[3] / len(rows) < 0.78


def test_logprobs_are_reported_before_logit_bias_as_openai_does() -> None:
    logits = torch.zeros(1, VOCAB)
    out = Sampler([EOS])(logits, [seq(temperature=0.0, logprobs=True, logit_bias={8: 50.0})])
    assert out.token_ids == [8]
    assert out.logprobs[0] == pytest.approx(-math.log(VOCAB), abs=1e-5)
