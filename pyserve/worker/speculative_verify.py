"""Speculative decoding's verification: accept or reject drafted tokens against the target.

A request proposes ``k`` drafted tokens ``d_0 .. d_{k-1}``; the target model scores its ``k + 1``
positions in one forward pass. Position ``i`` predicts the token after the output extended by
``d_0 .. d_{i-1}``. :func:`verify_drafts` turns those logits into the accepted count ``a``
(``0 .. k``) and ``a + 1`` tokens to emit: the accepted drafts, then either the correction at the
first rejection or, when all ``k`` are accepted, a bonus token drawn at position ``k``.

**The target distribution** ``p_i`` of each position is exactly the :class:`Sampler`'s, built by
the same functions in the same order, for a request whose output is ``output_ids + d_0 ..
d_{i-1}``: ``min_tokens`` bans (they lift once the drafts make the output long enough),
``logit_bias``, the grammar mask, penalties (the drafts count as output), then temperature,
min_p, top_k and top_p.

**Acceptance** (Leviathan et al. / Chen et al.), with one uniform ``u_i`` per position reached:

- greedy (temperature 0): ``d_i`` is accepted iff it is the argmax of the processed logits; the
  correction (or bonus) is that argmax. No random number is drawn;
- a draft model's probabilities ``q`` given: accept iff ``u_i * q_i(d_i) < p_i(d_i)`` (probability
  ``min(1, p/q)``); on rejection the correction is drawn from ``max(0, p_i - q_i)`` normalised,
  with ``u_i`` rescaled onto the rejected range ``(u_i - p/q) / (1 - p/q)`` (uniform on [0, 1)
  given the rejection, so no second number is needed);
- n-gram drafts (``q`` None: a point mass on ``d_i``): the token ``t_i`` the Sampler would draw at
  position ``i`` with ``u_i`` (same inverse-CDF layout) is computed, and ``d_i`` is accepted iff
  ``t_i == d_i``; otherwise ``t_i`` is the correction. That accepts with probability ``p_i(d_i)``
  and, on rejection, yields ``p_i`` with ``d_i`` removed and renormalised: exactly rejection
  sampling against a point mass;
- the bonus token at position ``k`` is the Sampler's draw with ``u_k``.

**Seeds.** A request draws its uniforms from its own generator (the Sampler's shared one when
unseeded), one per position reached, in position order: ``a + 1`` numbers for ``a + 1`` emitted
tokens, exactly what ``a + 1`` plain decoding steps consume. Hence, given the same logits at each
position:

- greedy requests emit exactly the tokens of plain greedy decoding;
- seeded requests with n-gram drafts emit exactly the tokens of plain seeded decoding, whatever
  the drafts are (each emitted token is the Sampler's draw with the number plain decoding would
  have used for it), and the generator is left in the same state;
- seeded requests with draft-model probabilities are reproducible (same seed, same drafts, same
  logits → same output) and keep the generator in step, but their tokens differ from plain
  decoding's: the accept test and the residual draw use the numbers differently.

"Same logits" is the caveat: a forward pass over ``k + 1`` positions may round differently from
``k + 1`` single-token steps, so near-ties can still go another way in a real server.

**Grammar masks.** Per proposal, ``allowed`` is either a bool tensor ``[k + 1, vocab]`` (the
tokens the grammar allows at each position, computed by advancing a copy of the matcher through
the drafts) or a callable ``allowed(i) -> bool [vocab]`` called for ``i = 0, 1, ..`` in order, and
only for positions reached: when it is called for ``i``, drafts ``0 .. i-1`` are grammar-valid,
so the caller can advance its matcher by them. A draft the mask forbids is rejected before any
test (the positions after it are never scored, nor their masks asked for); the correction at
its position is drawn from the masked ``p_i``. The caller advances the real matcher by the emitted
tokens afterwards.

**Stops are the caller's.** Drafts are verified as tokens like any other: an EOS or stop token
among the accepted drafts does not end verification here. The caller truncates the emitted tokens
after the first stop (and at ``max_new_tokens``), as it does for plain decoding.

**Logprobs** of each emitted token come from the unmodified ``log_softmax`` of its position's
logits, as the Sampler reports them (``top_logprobs`` alike).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker.grammar_masks import StepMasks, apply_masks
from pyserve.worker.sampling import (
    Sampler,
    SamplingSequence,
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    argmax_rows,
    ban_stop_tokens_before_min_tokens,
    draw,
    has_penalties,
    is_greedy,
    top_k_top_p,
)

# the tokens a grammar allows at each position: bool [k + 1, vocab], or position -> bool [vocab]
AllowedTokens = torch.Tensor | Callable[[int], torch.Tensor]


@dataclass
class DraftProposal:
    """One request's drafts and what is needed to verify them."""

    seq: SamplingSequence  # its state before the drafts: output_ids holds no draft
    draft_ids: list[int]  # k drafted tokens (k may be 0)
    # float [k, vocab]: the draft model's distribution at each drafted position (summing to 1);
    # None for drafts without probabilities (n-gram lookup), taken as point masses
    draft_probs: torch.Tensor | None = None
    allowed: AllowedTokens | None = None  # the grammar's mask, when the request has one


@dataclass
class VerifyOutput:
    accepted: int  # a, in 0 .. k
    token_ids: list[int]  # the a accepted drafts, then the correction or bonus token: a + 1
    logprobs: list[float] | None  # of each emitted token, when the request asked for logprobs
    # of each emitted token: (ids, logprobs) of the best ``top_logprobs``, when asked for
    top_logprobs: list[tuple[list[int], list[float]]] | None


@dataclass
class _Position:
    """The request as the Sampler would see it at one drafted position."""

    params: SamplingParams
    prompt_ids: torch.Tensor
    output_ids: list[int]
    generator: torch.Generator | None


@dataclass
class _Target:
    """The processed distributions of the scored rows, in the Sampler's own layouts."""

    greedy_tokens: torch.Tensor | None  # int64 per row, for greedy rows (others: unused)
    # row -> (ids [W] or None for the whole vocabulary in order, probabilities [W] or [vocab])
    layouts: dict[int, tuple[torch.Tensor | None, torch.Tensor]]


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, proposals: Sequence[DraftProposal]
) -> list[VerifyOutput]:
    """Verifies each proposal's drafts against the target's ``logits``.

    ``logits`` is float32 ``[sum(k_r + 1), vocab]``: the ``k_r + 1`` positions of each proposal in
    turn, in proposal order (it is not modified). ``sampler`` supplies the EOS ids (for
    ``min_tokens``) and the generator of unseeded requests. Returns one :class:`VerifyOutput` a
    proposal. See the module's docstring for the rules.
    """
    vocab = logits.shape[1]
    expected = sum(len(p.draft_ids) + 1 for p in proposals)
    if logits.shape[0] != expected:
        raise ValueError(f"{logits.shape[0]} rows of logits for {expected} drafted positions")
    for p in proposals:
        k = len(p.draft_ids)
        if p.draft_probs is not None and tuple(p.draft_probs.shape) != (k, vocab):
            raise ValueError(f"draft_probs of shape {tuple(p.draft_probs.shape)}, not {(k, vocab)}")

    # which positions can be reached: a grammar-forbidden draft ends the proposal there
    masks: list[list[torch.Tensor] | None] = []
    reached: list[int] = []
    for p in proposals:
        if p.allowed is None:
            masks.append(None)
            reached.append(len(p.draft_ids) + 1)
            continue
        rows = _reachable_masks(p)
        masks.append(rows)
        reached.append(len(rows))

    # the rows scored: position i of proposal r, as the Sampler would see it
    row_index: list[int] = []
    positions: list[_Position] = []
    first_row: list[int] = []
    offset = 0
    for p, n in zip(proposals, reached, strict=True):
        first_row.append(len(positions))
        seq = p.seq
        for i in range(n):
            row_index.append(offset + i)
            positions.append(
                _Position(seq.params, seq.prompt_ids, seq.output_ids + p.draft_ids[:i], None)
            )
        offset += len(p.draft_ids) + 1
    device = logits.device
    work = logits[torch.tensor(row_index, device=device)].clone()

    params = [s.params for s in positions]
    want_logprobs = any(p.logprobs or p.top_logprobs > 0 for p in params)
    raw_logprobs = torch.log_softmax(work, dim=-1) if want_logprobs else None

    ban_stop_tokens_before_min_tokens(work, positions, sampler.eos_token_ids)
    add_logit_bias(work, params)
    mask_rows = [
        first_row[r] + i
        for r, rows in enumerate(masks)
        if rows is not None
        for i in range(len(rows))
    ]
    if mask_rows:
        allowed = torch.stack([m.to(torch.bool).cpu() for rows in masks if rows for m in rows])
        apply_masks(work, StepMasks.from_allowed(mask_rows, allowed.numpy()))
    penalised = [i for i, p in enumerate(params) if has_penalties(p)]
    if penalised:
        index = torch.tensor(penalised, device=device)
        work[index] = apply_penalties(work[index], [positions[i] for i in penalised])
    target = _target_layouts(work, params)

    results = []
    for r, p in enumerate(proposals):
        generator = p.seq.generator or sampler.shared_generator
        accepted, tokens = _accept(p, target, first_row[r], reached[r], generator, vocab)
        results.append(
            _with_logprobs(accepted, tokens, raw_logprobs, first_row[r], p.seq.params, vocab)
        )
    return results


def _reachable_masks(p: DraftProposal) -> list[torch.Tensor]:
    """The masks of the positions up to the first grammar-forbidden draft (included)."""
    assert p.allowed is not None
    k = len(p.draft_ids)
    rows = []
    for i in range(k + 1):
        mask = p.allowed[i] if isinstance(p.allowed, torch.Tensor) else p.allowed(i)
        rows.append(mask)
        if i < k and not bool(mask[p.draft_ids[i]]):
            break  # a rejection before verification: nothing after it is scored
    return rows


def _target_layouts(work: torch.Tensor, params: list[SamplingParams]) -> _Target:
    """Temperature, min_p, top_k and top_p, grouped as the Sampler groups them, so that a draw
    with the same uniform lands on the same token."""
    device = work.device
    vocab = work.shape[1]
    greedy = [is_greedy(p) for p in params]
    greedy_tokens = argmax_rows(work) if any(greedy) else None
    layouts: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    random_rows = [i for i, g in enumerate(greedy) if not g]
    if not random_rows:
        return _Target(greedy_tokens, layouts)
    rparams = [params[i] for i in random_rows]
    temperatures = torch.tensor([p.temperature for p in rparams], device=device)
    scaled = work[torch.tensor(random_rows, device=device)] / temperatures.unsqueeze(1)
    if any(p.min_p > 0.0 for p in rparams):
        scaled = apply_min_p(scaled, [p.min_p for p in rparams])
    truncated = [j for j, p in enumerate(rparams) if 0 < p.top_k < vocab or p.top_p < 1.0]
    full = [j for j, p in enumerate(rparams) if not (0 < p.top_k < vocab or p.top_p < 1.0)]
    if truncated:
        ids, probs = top_k_top_p(
            scaled[torch.tensor(truncated, device=device)],
            top_k=[rparams[j].top_k for j in truncated],
            top_p=[rparams[j].top_p for j in truncated],
        )
        for n, j in enumerate(truncated):
            layouts[random_rows[j]] = (ids[n], probs[n])
    if full:
        probs = torch.softmax(scaled[torch.tensor(full, device=device)], dim=-1)
        for n, j in enumerate(full):
            layouts[random_rows[j]] = (None, probs[n])
    return _Target(greedy_tokens, layouts)


def _accept(
    p: DraftProposal,
    target: _Target,
    first: int,
    reached: int,
    generator: torch.Generator,
    vocab: int,
) -> tuple[int, list[int]]:
    k = len(p.draft_ids)
    greedy = is_greedy(p.seq.params)
    tokens: list[int] = []
    for i in range(reached):
        row = first + i
        draft = p.draft_ids[i] if i < k else None
        # the last reached position before k holds a grammar-forbidden draft
        forbidden = draft is not None and i == reached - 1
        if greedy:
            assert target.greedy_tokens is not None
            token = int(target.greedy_tokens[row])
            if token == draft and not forbidden:
                tokens.append(token)
                continue
            tokens.append(token)
            return i, tokens
        u = torch.rand(1, dtype=torch.float64, device=generator.device, generator=generator)
        ids, probs = target.layouts[row]
        if draft is None or p.draft_probs is None or forbidden:
            # the Sampler's own draw: accepting iff it hits the draft is exact for point masses
            token = _draw_one(ids, probs, u)
            if token == draft and not forbidden:
                tokens.append(token)
                continue
            tokens.append(token)
            return i, tokens
        p_full = _full(ids, probs, vocab).double()
        q_row = p.draft_probs[i].to(p_full.device, torch.float64)
        p_d, q_d = float(p_full[draft]), float(q_row[draft])
        u_value = float(u)
        if u_value * q_d < p_d:
            tokens.append(draft)
            continue
        residual = (p_full - q_row).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:
            residual = p_full  # p <= q everywhere only by rounding: p itself is the residual
        # given a rejection, u is uniform on [p/q, 1): rescaled, it draws the correction
        ratio = p_d / q_d if q_d > 0.0 else 0.0
        rescaled = min(max((u_value - ratio) / (1.0 - ratio), 0.0), 1.0 - 2**-53)
        token = int(draw(residual[None], torch.tensor([rescaled], dtype=torch.float64))[0])
        tokens.append(token)
        return i, tokens
    raise AssertionError("unreachable: the last position always emits a token")


def _draw_one(ids: torch.Tensor | None, probs: torch.Tensor, u: torch.Tensor) -> int:
    picked = draw(probs[None], u.to(probs.device))
    return int(picked[0] if ids is None else ids[picked[0]])


def _full(ids: torch.Tensor | None, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """A layout's probabilities over the whole vocabulary, in token order."""
    if ids is None:
        return probs
    return torch.zeros(vocab, dtype=probs.dtype, device=probs.device).index_add_(0, ids, probs)


def _with_logprobs(
    accepted: int,
    tokens: list[int],
    raw_logprobs: torch.Tensor | None,
    first: int,
    params: SamplingParams,
    vocab: int,
) -> VerifyOutput:
    if raw_logprobs is None or not (params.logprobs or params.top_logprobs > 0):
        return VerifyOutput(accepted, tokens, None, None)
    rows = raw_logprobs[first : first + len(tokens)]
    index = torch.tensor(tokens, device=rows.device)
    logprobs = rows.gather(1, index[:, None]).squeeze(1).tolist()
    if params.top_logprobs == 0:
        return VerifyOutput(accepted, tokens, logprobs, None)
    values, ids = rows.topk(min(params.top_logprobs, vocab), dim=-1)
    tops = list(zip(ids.tolist(), values.tolist(), strict=True))
    return VerifyOutput(accepted, tokens, logprobs, tops)
