"""Batched sampling: logits of one Step's sampling entries → one token each (issue 3, §4).

Per row, in the order vLLM applies them:

1. logprobs are read from the *unmodified* ``log_softmax(logits)`` (as OpenAI reports them);
2. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are banned while the
   request has fewer than ``min_tokens`` output tokens;
3. penalties: repetition over prompt + output (positive logits divided, negative multiplied),
   frequency (× count in the output) and presence (once if in the output) subtracted;
4. temperature 0 → argmax; otherwise logits / temperature, then min_p (relative to the top
   token's probability), top_k, top_p (over the distribution left by top_k), and a draw.

Draws use the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which samples exactly from
``p``. A request with a seed draws its ``q`` row from its own ``torch.Generator``, so its tokens
depend only on its seed and its own logits, never on what else is in the batch. Everything is
vectorised over the batch; Python loops run once per request, never per vocab entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pyserve.wire.main_to_worker import SamplingParams

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


def validate_params(params: SamplingParams) -> None:
    """Raises ValueError for values that would make sampling meaningless (NaN, no candidates)."""
    problems = []
    if params.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if not params.temperature >= 0.0:
        problems.append(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        problems.append(f"top_p must be in (0, 1], got {params.top_p}")
    if not 0.0 <= params.min_p <= 1.0:
        problems.append(f"min_p must be in [0, 1], got {params.min_p}")
    if not params.repetition_penalty > 0.0:
        problems.append(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.min_tokens < 0 or params.top_logprobs < 0:
        problems.append("min_tokens and top_logprobs must be >= 0")
    if problems:
        raise ValueError("; ".join(problems))


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator (None without a seed); any int seed maps to a 64-bit one."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


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

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SamplingSequence]) -> SampleOutput:
        """Samples one token for each row of ``logits`` (modified in place)."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} requests")
        params = [s.params for s in seqs]
        num_top = min(max(p.top_logprobs for p in params), logits.shape[1])
        want_logprobs = num_top > 0 or any(p.logprobs for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        self._ban_stop_tokens_before_min_tokens(logits, seqs)
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        if penalised:
            rows = torch.tensor(penalised, device=logits.device)
            logits[rows] = apply_penalties(logits[rows], [seqs[i] for i in penalised])

        greedy = [is_greedy(p) for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random_rows(logits, seqs, greedy)

        return _gather_logprobs(tokens, raw_logprobs, params, num_top)

    def _ban_stop_tokens_before_min_tokens(
        self, logits: torch.Tensor, seqs: Sequence[SamplingSequence]
    ) -> None:
        vocab = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if len(seq.output_ids) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(self.eos_token_ids)
            banned = [t for t in banned if 0 <= t < vocab]
            rows.extend([i] * len(banned))
            cols.extend(banned)
        if rows:
            device = logits.device
            logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = _NEG_INF

    def _sample_random_rows(
        self, logits: torch.Tensor, seqs: Sequence[SamplingSequence], greedy: list[bool]
    ) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        rows = torch.tensor(random_rows, device=logits.device)
        params = [seqs[i].params for i in random_rows]
        scaled = logits[rows] / torch.tensor(
            [p.temperature for p in params], device=logits.device
        ).unsqueeze(1)
        filtered = apply_filters(
            scaled,
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
        )
        probs = torch.softmax(filtered, dim=-1)
        noise = self._exponential_noise(probs, [seqs[i].generator for i in random_rows])
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def _exponential_noise(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if all(g is None for g in generators):
            noise.exponential_(generator=self._shared)
        else:
            for row, generator in enumerate(generators):
                noise[row].exponential_(generator=generator or self._shared)
        # exponential_ can return exactly 0, which would make p / q infinite for any p
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def apply_penalties(logits: torch.Tensor, seqs: Sequence[SamplingSequence]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties, as in vLLM."""
    num_rows, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts(
        [torch.tensor(s.output_ids, dtype=torch.int64) for s in seqs], vocab, device
    )
    prompt_seen = _token_counts([s.prompt_ids for s in seqs], vocab, device) > 0
    output_seen = output_counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    repetition = column([s.params.repetition_penalty for s in seqs]).expand(num_rows, vocab)
    repetition = torch.where(prompt_seen | output_seen, repetition, 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - column([s.params.frequency_penalty for s in seqs]) * output_counts
    return logits - column([s.params.presence_penalty for s in seqs]) * output_seen


def _token_counts(ids: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """float32 ``[len(ids), vocab]``: how often each token occurs in each row's ids."""
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    if any(t.numel() for t in ids):
        # pad with the extra column ``vocab`` so padding lands outside the real vocabulary
        padded = torch.nn.utils.rnn.pad_sequence(
            [t.to(device=device, dtype=torch.int64) for t in ids],
            batch_first=True,
            padding_value=vocab,
        )
        padded = padded.clamp_(0, vocab)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_filters(
    logits: torch.Tensor, *, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Sets to -inf what min_p, then top_k, then top_p remove (rows of temperature-scaled logits).

    min_p keeps tokens with ``p >= min_p * p_max``; top_k keeps tokens whose logit is at least the
    k-th largest (ties at the boundary are kept); top_p keeps the smallest set of most likely
    tokens, renormalised after top_k, whose mass reaches ``top_p``. The top token always stays.
    """
    vocab = logits.shape[1]
    device = logits.device
    use_min_p = any(m > 0.0 for m in min_p)
    use_top_k = any(0 < k < vocab for k in top_k)
    use_top_p = any(p < 1.0 for p in top_p)
    if use_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device)[:, None]
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    if not (use_top_k or use_top_p):
        return logits

    # k = vocab keeps everything: the k-th largest is the smallest logit
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
    if not use_top_p:
        kth = logits.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
        return logits.masked_fill(logits < kth, _NEG_INF)

    ordered, order = logits.sort(dim=-1, descending=True)
    if use_top_k:
        kth = ordered.gather(1, (ks - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, _NEG_INF)
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # rows without top_p get a bound no rounding error can reach
    bound = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], device=device)[:, None]
    drop = mass_before >= bound
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


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
