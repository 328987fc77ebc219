"""Batched sampling: logits of one Step's sampling entries → one token each.

Per row, in the order vLLM applies them:

1. logprobs are read from the *unmodified* ``log_softmax(logits)`` (as OpenAI reports them);
2. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are banned while the
   request has fewer than ``min_tokens`` output tokens;
3. ``logit_bias`` is added (OpenAI's semantics: -100 bans a token, +100 all but forces it);
4. a grammar's mask, when the request has one, sets every token it forbids to -inf;
5. penalties: repetition over prompt + output (positive logits divided, negative multiplied),
   frequency (× count in the output) and presence (once if in the output) subtracted;
6. temperature 0 → argmax; otherwise logits / temperature, then min_p (relative to the top
   token's probability), top_k, top_p (over the distribution left by top_k), and a draw.

A draw is an inverse-CDF lookup of one uniform number a row. A request with a seed takes its
number from its own ``torch.Generator``, so its tokens depend only on its seed and its own
logits, never on what else is in the batch. Everything is vectorised over the batch; Python
loops run once per request, never per vocab entry; top_k/top_p look at a window of the most
likely tokens (``topk``) rather than sorting the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker.grammar_masks import StepMasks, apply_masks

# temperatures below this are greedy (as in vLLM): dividing by them would overflow
GREEDY_TEMPERATURE = 1e-5
_NEG_INF = float("-inf")


class SamplingSequence(Protocol):
    """What the sampler reads from a request's state."""

    params: SamplingParams
    prompt_ids: torch.Tensor  # int64 [P]
    output_ids: list[int]
    generator: torch.Generator | None


@dataclass
class SampleOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # of each sampled token, when any row asked for logprobs
    # per row: (token ids, logprobs) of the best ``top_logprobs`` tokens, best first, or None
    top_logprobs: list[tuple[list[int], list[float]] | None] | None


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator (None without a seed); any int seed maps to a 64-bit one."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, through numpy for float32 on the CPU: its vectorised argmax
    is much faster than torch's on the batch and vocabulary sizes served, with the same result
    (the first maximum; the first NaN if any)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def ban_stop_tokens_before_min_tokens(
    logits: torch.Tensor, seqs: Sequence[SamplingSequence], eos_token_ids: Sequence[int]
) -> None:
    """Sets to -inf, in place, the EOS (unless ``ignore_eos``) and ``stop_token_ids`` logits of
    the rows whose request has fewer than ``min_tokens`` output tokens."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(eos_token_ids)
        banned = [t for t in banned if 0 <= t < vocab]
        rows.extend([i] * len(banned))
        cols.extend(banned)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = _NEG_INF


class Sampler:
    """Turns float32 logits ``[S, V]`` into one token per row."""

    def __init__(
        self,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
        seed: int | None = None,
    ) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        # unseeded requests share this generator (not the global RNG, which user code may touch)
        self._shared = torch.Generator(device=self.device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    @property
    def shared_generator(self) -> torch.Generator:
        """The generator of unseeded requests (speculative verification draws from it too)."""
        return self._shared

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SamplingSequence],
        grammar_masks: StepMasks | None = None,
    ) -> SampleOutput:
        """Samples one token for each row of ``logits`` (modified in place); ``grammar_masks``
        are the allowed tokens of the constrained rows."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} requests")
        params = [s.params for s in seqs]
        num_top = min(max(p.top_logprobs for p in params), logits.shape[1])
        want_logprobs = num_top > 0 or any(p.logprobs for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        ban_stop_tokens_before_min_tokens(logits, seqs, self.eos_token_ids)
        add_logit_bias(logits, params)
        if grammar_masks is not None:
            apply_masks(logits, grammar_masks)
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        if penalised:
            rows = torch.tensor(penalised, device=logits.device)
            logits[rows] = apply_penalties(logits[rows], [seqs[i] for i in penalised])

        greedy = [is_greedy(p) for p in params]
        if all(greedy):
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample_random_rows(logits, seqs, greedy)

        return _gather_logprobs(tokens, raw_logprobs, params, num_top)

    def _sample_random_rows(
        self, logits: torch.Tensor, seqs: Sequence[SamplingSequence], greedy: list[bool]
    ) -> torch.Tensor:
        device = logits.device
        tokens = (
            argmax_rows(logits)
            if any(greedy)
            else torch.empty_like(logits[:, 0], dtype=torch.int64)
        )
        random_rows = [i for i, g in enumerate(greedy) if not g]
        params = [seqs[i].params for i in random_rows]
        temperatures = torch.tensor([p.temperature for p in params], device=device)
        scaled = logits[torch.tensor(random_rows, device=device)] / temperatures.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            scaled = apply_min_p(scaled, [p.min_p for p in params])
        uniforms = self._uniforms([seqs[i].generator for i in random_rows], device)

        vocab = logits.shape[1]
        truncated = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        full = [j for j, p in enumerate(params) if not (0 < p.top_k < vocab or p.top_p < 1.0)]
        picked = torch.empty(len(random_rows), dtype=torch.int64, device=device)
        if truncated:
            index = torch.tensor(truncated, device=device)
            ids, probs = top_k_top_p(
                scaled[index],
                top_k=[params[j].top_k for j in truncated],
                top_p=[params[j].top_p for j in truncated],
            )
            picked[index] = ids.gather(1, draw(probs, uniforms[index])[:, None]).squeeze(1)
        if full:
            index = torch.tensor(full, device=device)
            picked[index] = draw(torch.softmax(scaled[index], dim=-1), uniforms[index])
        tokens[torch.tensor(random_rows, device=device)] = picked
        return tokens

    def _uniforms(
        self, generators: list[torch.Generator | None], device: torch.device
    ) -> torch.Tensor:
        """float64 ``[n]`` in [0, 1): one draw per row, from the row's own generator if seeded."""
        shared = torch.rand(
            len(generators), dtype=torch.float64, device=device, generator=self._shared
        )
        for row, generator in enumerate(generators):
            if generator is not None:
                shared[row] = torch.rand(
                    1, dtype=torch.float64, device=device, generator=generator
                )[0]
        return shared


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column index of one draw per row of ``probs`` (rows need not sum to 1), by inverse CDF.

    One uniform a row instead of one random number per vocab entry: the draw is cheap, and a
    seeded row consumes exactly one number of its generator per token. The CDF is summed in
    float64 so that even tiny probabilities keep their share.
    """
    cdf = probs.double().cumsum_(dim=-1)
    targets = uniforms * cdf[:, -1]
    picked = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)  # only when rounding lands on the total


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Adds each row's ``logit_bias`` to its logits, in place (ids were checked on admission)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            cols.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), True)


def apply_penalties(logits: torch.Tensor, seqs: Sequence[SamplingSequence]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties, as in vLLM.

    Modifies ``logits`` in place and returns it. Only the entries of tokens a request has seen
    are touched: they are found as sorted unique keys ``row * vocab + token``, so the cost
    follows the number of tokens, not the size of the vocabulary.
    """
    vocab = logits.shape[1]
    device = logits.device
    outputs = [torch.tensor(s.output_ids, dtype=torch.int64) for s in seqs]
    prompts = [s.prompt_ids.to(torch.int64) for s in seqs]
    out_keys = _row_keys(outputs, vocab).to(device)
    seen = torch.unique(torch.cat([_row_keys(prompts, vocab).to(device), out_keys]))
    if seen.numel() == 0:
        return logits
    # how often each seen key occurs in the output (0 for prompt-only tokens)
    counts = torch.zeros(seen.shape, dtype=logits.dtype, device=device)
    if out_keys.numel():
        out_unique, out_counts = torch.unique(out_keys, return_counts=True)
        at = torch.searchsorted(out_unique, seen).clamp_(max=out_unique.numel() - 1)
        counts = torch.where(out_unique[at] == seen, out_counts[at].to(logits.dtype), 0.0)

    rows, cols = seen // vocab, seen % vocab

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[rows]

    values = logits[rows, cols]
    repetition = per_row([s.params.repetition_penalty for s in seqs])
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= per_row([s.params.frequency_penalty for s in seqs]) * counts
    values -= per_row([s.params.presence_penalty for s in seqs]) * (counts > 0)
    logits[rows, cols] = values
    return logits


def _row_keys(ids: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """``row * vocab + token`` for every token of every row, concatenated."""
    lengths = torch.tensor([t.numel() for t in ids])
    rows = torch.repeat_interleave(torch.arange(len(ids)), lengths)
    return rows * vocab + torch.cat(ids).clamp_(0, vocab - 1)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Sets to -inf tokens less likely than ``min_p`` times the most likely one, row by row."""
    probs = torch.softmax(logits, dim=-1)
    factors = torch.tensor(min_p, dtype=probs.dtype, device=logits.device)[:, None]
    return logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * factors, _NEG_INF)


# top_k/top_p look at this many most likely tokens first, and widen the window only for rows
# whose kept set does not end inside it; a full sort of the vocabulary is the last resort.
_FIRST_WINDOW = 128
_WINDOW_GROWTH = 8


def top_k_top_p(
    logits: torch.Tensor, *, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution left by top_k, then top_p, as (token ids, probabilities), ``[n, W]`` each.

    top_k keeps tokens whose logit is at least the k-th largest (k <= 0 or >= vocab: all);
    top_p keeps the smallest set of most likely tokens, renormalised after top_k, whose mass
    reaches p (the top token always stays). Removed tokens get probability 0; rows sum to 1.
    """
    vocab = logits.shape[1]
    device = logits.device
    k_on = [0 < k < vocab for k in top_k]
    ks = torch.tensor([k if on else 1 for k, on in zip(top_k, k_on, strict=True)], device=device)
    # rows without top_p get a bound that no accumulated mass reaches
    bounds = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], device=device)
    largest_k = max((k for k, on in zip(top_k, k_on, strict=True) if on), default=0)
    ids, probs = _window_top_k_top_p(
        logits,
        ks,
        torch.tensor(k_on, device=device),
        bounds,
        torch.logsumexp(logits, dim=-1),
        window=max(_FIRST_WINDOW, largest_k),
    )
    return ids, probs / probs.sum(dim=-1, keepdim=True)


def _window_top_k_top_p(
    logits: torch.Tensor,
    ks: torch.Tensor,
    k_on: torch.Tensor,
    bounds: torch.Tensor,
    log_total: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = logits.shape[1]
    if window * 4 >= vocab:
        window = vocab
        values, ids = logits.sort(dim=-1, descending=True)
    else:
        values, ids = logits.topk(window, dim=-1)  # sorted, most likely first
    k_on = k_on[:, None]
    kth = values.gather(1, (ks - 1)[:, None])
    values = values.masked_fill(k_on & (values < kth), _NEG_INF)
    # after top_k the kept set lies inside the window: renormalise over it; without top_k,
    # probabilities are relative to the whole vocabulary
    probs = torch.where(k_on, torch.softmax(values, dim=-1), torch.exp(values - log_total[:, None]))
    drop = probs.cumsum(dim=-1) - probs >= bounds[:, None]
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    complete = k_on.squeeze(1) | drop[:, -1]
    if window == vocab or bool(complete.all()):
        return ids, probs
    redo = (~complete).nonzero().squeeze(1)
    wide_ids, wide_probs = _window_top_k_top_p(
        logits[redo], ks[redo], k_on.squeeze(1)[redo], bounds[redo], log_total[redo],
        window * _WINDOW_GROWTH,
    )  # fmt: skip
    pad = wide_ids.shape[1] - window
    ids = torch.nn.functional.pad(ids, (0, pad))
    probs = torch.nn.functional.pad(probs, (0, pad))
    ids[redo] = wide_ids
    probs[redo] = wide_probs
    return ids, probs


def _gather_logprobs(
    tokens: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    params: list[SamplingParams],
    num_top: int,
) -> SampleOutput:
    token_list = tokens.tolist()
    if raw_logprobs is None:
        return SampleOutput(token_list, None, None)
    sampled = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    if num_top == 0:
        return SampleOutput(token_list, sampled, None)
    top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    tops: list[tuple[list[int], list[float]] | None] = []
    for row, p in enumerate(params):
        k = p.top_logprobs
        tops.append((top_ids[row][:k], top_values[row][:k]) if k > 0 else None)
    return SampleOutput(token_list, sampled, tops)
