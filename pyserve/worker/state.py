"""The worker's per-request state, and the translation of a Step into a ForwardBatch.

The worker keeps, for each live request: its sampling params and generator, prompt and
generated ids, its block table (grown or replaced by each Step's block entries) and the last
sampled token, which is the input of its next decode entry, so a decode needs no round trip to
the main process.

Because the scheduler runs ahead (DESIGN.md, "Overlap"), a request that finished here at Step N
may still appear in Step N+1: it is computed (its state is kept until a Step lists it in
``dropped``) but the token it samples is discarded, never reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pyserve.wire.main_to_worker import NewRequest, SamplingParams, Step
from pyserve.wire.worker_to_detok import (
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    StepTokens,
    TopLogprobs,
)
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.sampling import SampleOutput, make_generator, validate_params


@dataclass(eq=False)
class RequestState:
    rid: int
    params: SamplingParams
    prompt_ids: torch.Tensor  # int64 [P]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    last_token: int | None = None
    finished: bool = False  # EOS/length seen here, or dropped: later tokens are discarded


@dataclass
class PreparedStep:
    step_id: int
    batch: ForwardBatch
    sampling: list[RequestState]  # one per sampling entry, in entry order
    dropped: bytes  # int64, forwarded to the detokenizer


class RequestTable:
    """rid → RequestState, plus Step → ForwardBatch and sampled tokens → StepTokens."""

    def __init__(
        self, *, block_size: int, eos_token_ids: list[int], device: torch.device | str = "cpu"
    ) -> None:
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)
        self._requests: dict[int, RequestState] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, rid: int) -> bool:
        return rid in self._requests

    def get(self, rid: int) -> RequestState:
        return self._requests[rid]

    def add(self, request: NewRequest) -> RequestState:
        if request.rid in self._requests:
            raise ValueError(f"request {request.rid} is already known to the worker")
        validate_params(request.sampling)
        prompt = np.frombuffer(request.prompt_ids, dtype="<i4").astype(np.int64)
        if prompt.size == 0:
            raise ValueError(f"request {request.rid} has an empty prompt")
        state = RequestState(
            rid=request.rid,
            params=request.sampling,
            prompt_ids=torch.from_numpy(prompt),
            generator=make_generator(request.sampling.seed, self.device),
        )
        self._requests[request.rid] = state
        return state

    def add_rejected(self, request: NewRequest) -> RequestState:
        """Registers a request whose NewRequest was invalid, already finished.

        Steps planned before main learns of the rejection still name it; they must run for the
        other requests in them, so this one is computed greedily and its tokens discarded.
        """
        state = self._requests.get(request.rid)
        if state is None:
            state = RequestState(
                rid=request.rid,
                params=SamplingParams(max_new_tokens=1, temperature=0.0),
                prompt_ids=torch.zeros(1, dtype=torch.int64),
                generator=None,
            )
            self._requests[request.rid] = state
        state.finished = True
        return state

    def fail(self, rids: bytes) -> None:
        """Marks a failed step's requests finished: main fails them; later tokens are discarded."""
        for rid in np.frombuffer(rids, dtype="<i8").tolist():
            state = self._requests.get(rid)
            if state is not None:
                state.finished = True

    def drop(self, rids: bytes | list[int]) -> None:
        if isinstance(rids, bytes | bytearray | memoryview):
            rids = np.frombuffer(rids, dtype="<i8").tolist()
        for rid in rids:
            state = self._requests.pop(rid, None)
            if state is not None:
                state.finished = True

    def prepare(self, step: Step) -> PreparedStep:
        """Applies the Step's block-table entries and builds its ForwardBatch.

        Raises ValueError/KeyError naming the problem for a malformed Step; ``dropped`` is
        applied in any case (after the entries, in case a dropped rid is still in this Step).
        """
        try:
            return self._prepare(step)
        finally:
            self.drop(step.dropped)

    def _prepare(self, step: Step) -> PreparedStep:
        rids = np.frombuffer(step.rids, dtype="<i8")
        start_pos = np.frombuffer(step.start_pos, dtype="<i4").astype(np.int64)
        num_tokens = np.frombuffer(step.num_tokens, dtype="<i4").astype(np.int64)
        is_decode = np.frombuffer(step.is_decode, dtype=np.uint8).astype(bool)
        sample = np.frombuffer(step.sample, dtype=np.uint8).astype(bool)
        block_offsets = np.frombuffer(step.block_offsets, dtype="<i4")
        block_counts = np.frombuffer(step.block_counts, dtype="<i4")
        block_ids = np.frombuffer(step.block_ids, dtype="<i4")
        prefill_ids = np.frombuffer(step.input_ids, dtype="<i4")
        num_entries = len(rids)
        _check_step_shapes(
            step.step_id, num_entries, start_pos, num_tokens, is_decode, sample,
            block_offsets, block_counts, block_ids, prefill_ids,
        )  # fmt: skip

        total = int(num_tokens.sum())
        input_ids = np.empty(total, dtype=np.int64)
        states: list[RequestState] = []
        token_cursor = 0
        prefill_cursor = 0
        block_cursor = 0
        for i, rid in enumerate(rids.tolist()):
            state = self._requests.get(rid)
            if state is None:
                raise KeyError(f"step {step.step_id} names request {rid}, unknown to the worker")
            count = int(block_counts[i])
            _update_block_table(
                state, int(block_offsets[i]), block_ids[block_cursor : block_cursor + count]
            )
            block_cursor += count
            n = int(num_tokens[i])
            if len(state.block_table) * self.block_size < start_pos[i] + n:
                raise ValueError(
                    f"step {step.step_id}: request {rid} needs {start_pos[i] + n} token slots, "
                    f"its block table holds {len(state.block_table)} blocks of {self.block_size}"
                )
            if is_decode[i]:
                if state.last_token is None and state.finished:
                    state.last_token = 0  # its output is discarded: any valid input will do
                if state.last_token is None:
                    raise ValueError(
                        f"step {step.step_id}: decode entry for request {rid}, "
                        "which has sampled no token yet"
                    )
                input_ids[token_cursor] = state.last_token
            else:
                input_ids[token_cursor : token_cursor + n] = prefill_ids[
                    prefill_cursor : prefill_cursor + n
                ]
                prefill_cursor += n
            token_cursor += n
            states.append(state)

        ends = np.cumsum(num_tokens)
        positions = np.arange(total, dtype=np.int64) + np.repeat(
            start_pos - (ends - num_tokens), num_tokens
        )
        sample_index = ends[sample] - 1
        batch = ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            start_pos=start_pos.tolist(),
            num_tokens=num_tokens.tolist(),
            block_tables=[s.block_table for s in states],
            sample_index=torch.from_numpy(sample_index).to(self.device),
        )
        sampling = [s for s, wants in zip(states, sample.tolist(), strict=True) if wants]
        return PreparedStep(step.step_id, batch, sampling, step.dropped)

    def record(
        self, prepared: PreparedStep, out: SampleOutput | None, forward_ms: float
    ) -> StepTokens:
        """Appends sampled tokens, decides EOS/length finishes, and builds the StepTokens."""
        rids: list[int] = []
        tokens: list[int] = []
        finishes: list[int] = []
        logprobs: list[float] = []
        tops: list[TopLogprobs] = []
        for row, state in enumerate(prepared.sampling):
            assert out is not None
            token = out.token_ids[row]
            state.last_token = token  # a later overlapping decode of it still needs an input
            if state.finished:
                continue  # finished at an earlier step, or dropped: the scheduler ran ahead
            state.output_ids.append(token)
            finish = self._finish_code(state, token)
            state.finished = finish != FINISH_NONE
            if out.logprobs is not None:
                logprobs.append(out.logprobs[row])
            if out.top_logprobs is not None and out.top_logprobs[row] is not None:
                top_ids, top_values = out.top_logprobs[row]
                tops.append(
                    TopLogprobs(
                        index=len(rids),
                        token_ids=np.asarray(top_ids, dtype="<i4").tobytes(),
                        logprobs=np.asarray(top_values, dtype="<f4").tobytes(),
                    )
                )
            rids.append(state.rid)
            tokens.append(token)
            finishes.append(finish)
        return StepTokens(
            step_id=prepared.step_id,
            rids=np.asarray(rids, dtype="<i8").tobytes(),
            token_ids=np.asarray(tokens, dtype="<i4").tobytes(),
            finish=np.asarray(finishes, dtype=np.uint8).tobytes(),
            dropped=prepared.dropped,
            logprobs=np.asarray(logprobs, dtype="<f4").tobytes() if logprobs else b"",
            top_logprobs=tops,
            forward_ms=forward_ms,
        )

    def _finish_code(self, state: RequestState, token: int) -> int:
        params = state.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return FINISH_STOP
        if len(state.output_ids) >= params.max_new_tokens:
            return FINISH_LENGTH
        return FINISH_NONE


def _update_block_table(state: RequestState, offset: int, new_ids: np.ndarray) -> None:
    if len(new_ids) == 0:
        return  # nothing new (every entry computes ≥ 1 token, so an empty table never fits)
    table = state.block_table
    if offset > len(table) or offset < 0:
        raise ValueError(
            f"request {state.rid}: block entries start at {offset}, "
            f"but its block table has {len(table)} entries"
        )
    del table[offset:]  # offset 0 replaces the table (admission, recompute after retraction)
    table.extend(new_ids.tolist())


def _check_step_shapes(
    step_id: int,
    num_entries: int,
    start_pos: np.ndarray,
    num_tokens: np.ndarray,
    is_decode: np.ndarray,
    sample: np.ndarray,
    block_offsets: np.ndarray,
    block_counts: np.ndarray,
    block_ids: np.ndarray,
    prefill_ids: np.ndarray,
) -> None:
    per_entry = {
        "start_pos": start_pos,
        "num_tokens": num_tokens,
        "is_decode": is_decode,
        "sample": sample,
        "block_offsets": block_offsets,
        "block_counts": block_counts,
    }
    for name, values in per_entry.items():
        if len(values) != num_entries:
            raise ValueError(f"step {step_id}: {len(values)} {name} for {num_entries} entries")
    if (num_tokens < 1).any() or (start_pos < 0).any() or (block_counts < 0).any():
        raise ValueError(f"step {step_id}: negative positions or counts, or an empty entry")
    if (num_tokens[is_decode] != 1).any():
        raise ValueError(f"step {step_id}: a decode entry with more than one token")
    if int(block_counts.sum()) != len(block_ids):
        raise ValueError(
            f"step {step_id}: {len(block_ids)} block ids, counts say {block_counts.sum()}"
        )
    if int(num_tokens[~is_decode].sum()) != len(prefill_ids):
        raise ValueError(
            f"step {step_id}: {len(prefill_ids)} prefill input ids, "
            f"entries say {num_tokens[~is_decode].sum()}"
        )
