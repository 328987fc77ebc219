"""The worker's per-request state, and the translation of a Step into a ForwardBatch.

The worker keeps, for each live request: its sampling params and generator, prompt and
generated ids, its block table (grown or replaced by each Step's block entries) and the last
sampled token, which is the input of its next decode entry, so a decode needs no round trip to
the main process.

A verify entry (a decode entry of ``1 + k`` tokens: the last sampled token, then ``k`` drafts
from the Step) is sampled at each of its positions; speculative_verify.py decides how many
drafts stand, and the request emits them plus one token, reported one by one up to the first
that finishes it, exactly as that many plain decode steps would have.

A worker-drafted verify entry (``is_decode == 2``) is the same without drafts in the Step: the
worker's draft model (draft_model.py) writes them into the batch before the forward pass. For
it, each request tracks ``draft_computed``: the leading positions whose K/V in the draft model's
pool are valid under the request's current block table.

A chained entry (``is_decode == 3``) was planned behind its request's unreported verify entry,
as if that verify accepts every draft. Steps run in order, so the worker knows how the verify
came out: with the request's last sampled token at the entry's start, the entry runs as sent
(like ``is_decode == 1``); below it, as a plain 1-token decode at that token's position, its
drafts skipped (``_settle_chained``).

Because the scheduler runs ahead (DESIGN.md, "Overlap"), a request that finished here at Step N
may still appear in Step N+1: it is computed (its state is kept until a Step lists it in
``dropped``) but the token it samples is discarded, never reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pyserve.wire.main_to_worker import (
    NewRequest,
    Pooling,
    SamplingParams,
    Step,
    UncheckedNewRequest,
)
from pyserve.wire.worker_to_detok import (
    FINISH_GRAMMAR,
    FINISH_GRAMMAR_ERROR,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    StepTokens,
    TopLogprobs,
)
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.grammar_masks import GrammarMasks, GrammarState
from pyserve.worker.image_encoder import (
    ImageSlice,
    RequestImage,
    VisionModel,
    image_slices,
    row_runs,
)
from pyserve.worker.mrope import mrope_positions
from pyserve.worker.pooling import PoolingRows
from pyserve.worker.sampling import SampleOutput, make_generator
from pyserve.worker.speculative_verify import VerifyOutput


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
    grammar: GrammarState | None = None
    pooling: Pooling | None = None  # a prefill-only request's vector (pooling.py)
    pool_sum: torch.Tensor | None = None  # its hidden states summed over the chunks so far
    pool_rows: int = 0
    # leading positions with valid K/V in the draft model's pool (0 again whenever a Step
    # replaces the blocks under them), and the generator of the draft model's draws for a
    # seeded request (never its own generator, which feeds verification only)
    draft_computed: int = 0
    draft_generator: torch.Generator | None = None
    images: list[RequestImage] = field(default_factory=list)  # its prompt's images
    # multimodal rope (mrope.py): its prompt's rope positions [3, P], and the offset of every
    # later position's; None: its cache positions
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0


@dataclass(eq=False)
class DraftSlot:
    """A worker-drafted verify entry: ``k`` drafts for positions ``start + 1 .. start + k``,
    written into the batch's input ids from index ``at``."""

    entry: int  # its sampling entry index (a key of PreparedStep.verify)
    state: RequestState
    start: int  # the position of the request's last sampled token
    k: int
    at: int
    drafts: list[int] = field(default_factory=list)
    # float32 [k, vocab]: the draft model's distribution at each draft; None for greedy
    # requests, or drafts verified as point masses
    probs: torch.Tensor | None = None


@dataclass
class PreparedStep:
    step_id: int
    batch: ForwardBatch
    sampling: list[RequestState]  # one per sampling entry, in entry order
    dropped: bytes  # int64, forwarded to the detokenizer
    pooling: PoolingRows | None = None  # the rows its prefill-only requests need
    # sampling entry index -> the drafts its verify entry checks; its logits rows are the
    # 1 + k positions, in order (every other sampling entry has one row). Empty: none
    verify: dict[int, list[int]] = field(default_factory=dict)
    # the worker-drafted verify entries, in entry order; their verify drafts are placeholders
    # until the draft model has run
    drafted: list[DraftSlot] = field(default_factory=list)
    # the image embedding rows its prefill chunks take (image_encoder.py)
    images: list[ImageSlice] = field(default_factory=list)


class RequestTable:
    """rid → RequestState, plus Step → ForwardBatch and sampled tokens → StepTokens."""

    def __init__(
        self,
        *,
        block_size: int,
        eos_token_ids: list[int],
        device: torch.device | str = "cpu",
        grammars: GrammarMasks | None = None,
        vocab_size: int | None = None,
        vision: VisionModel | None = None,
    ) -> None:
        """``vocab_size``: ids at or above it (an image's positions, a draft copied from one)
        are embedded as id 0, their rows replaced or their drafts rejected; ``vision``: the
        model's images (None: requests with images are refused)."""
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.vision = vision
        self.mrope = 0  # live requests whose rope positions are not their cache positions
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)
        self.grammars = grammars
        self.constrained = 0  # live requests with a grammar: a step without any skips masks
        self.pooling = 0  # live prefill-only requests: a step without any skips their rows
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
        prompt = np.frombuffer(request.prompt_ids, dtype="<i4").astype(np.int64)
        if prompt.size == 0:
            raise ValueError(f"request {request.rid} has an empty prompt")
        images = []
        rope_positions, rope_delta = None, 0
        if request.images:
            vision = self.vision
            if vision is None:
                raise ValueError(f"request {request.rid} has images: this model takes none")
            images = [RequestImage.of(image, prompt.size) for image in request.images]
            for item in images:  # what penalties see there, as in transformers
                prompt[item.positions] = vision.token_id
            if vision.mrope_merge is not None:
                grids = [(item.positions, _grid(item)) for item in images]
                rope_positions, rope_delta = mrope_positions(prompt.size, grids, vision.mrope_merge)
        params = request.sampling
        if request.pooling is not None and params.max_new_tokens != 1:
            raise ValueError(f"request {request.rid} pools its prompt: max_new_tokens must be 1")
        grammar = None
        if self.grammars is not None:
            self.grammars.warm_up()  # the tokenizer file exists once requests arrive
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this worker runs without grammars")
            grammar = self.grammars.start(params.grammar)
            self.constrained += 1
        state = RequestState(
            rid=request.rid,
            params=params,
            prompt_ids=torch.from_numpy(prompt),
            generator=make_generator(params.seed, self.device),
            grammar=grammar,
            pooling=request.pooling,
            images=images,
            rope_positions=rope_positions,
            rope_delta=rope_delta,
        )
        self._requests[request.rid] = state
        self.mrope += rope_positions is not None
        self.pooling += request.pooling is not None
        return state

    def add_rejected(self, request: NewRequest | UncheckedNewRequest) -> RequestState:
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
                if state.grammar is not None:
                    self.constrained -= 1
                if state.pooling is not None:
                    self.pooling -= 1
                if state.rope_positions is not None:
                    self.mrope -= 1

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
        arrays = StepArrays.of(step)
        if arrays.top_kind == 3:  # the entries as they run: everything below follows them
            arrays = self._settle_chained(arrays, step.step_id)
        starts = arrays.start_pos.tolist()
        counts = arrays.num_tokens.tolist()
        decodes = arrays.decode_kind.tolist()  # 0, 1, or 2: drafted by the worker
        offsets = arrays.block_offsets.tolist()
        block_counts = arrays.block_counts.tolist()
        input_ids = np.empty(sum(counts), dtype=np.int64)
        states: list[RequestState] = []
        # decode inputs are gathered in lists and written at once: per entry, a numpy scalar
        # store costs more than the rest of this loop (256-entry steps, overhead benchmark)
        decode_slots: list[int] = []
        decode_inputs: list[int] = []
        requests, block_ids, block_size = self._requests, arrays.block_ids, self.block_size
        verify: dict[int, list[int]] = {}  # entry index -> drafts
        drafted: list[DraftSlot] = []  # keyed by entry index until the end
        images: list[ImageSlice] = []
        bidirectional: list[tuple[int, int, int]] = []
        token_cursor = prefill_cursor = block_cursor = 0
        for i, rid in enumerate(arrays.rids.tolist()):
            state = requests.get(rid)
            if state is None:
                raise KeyError(f"step {step.step_id} names request {rid}, unknown to the worker")
            if block_counts[i]:  # most decode steps bring no new block
                new_blocks = block_ids[block_cursor : block_cursor + block_counts[i]]
                _update_block_table(state, offsets[i], new_blocks, block_size)
                block_cursor += block_counts[i]
            n = counts[i]
            if len(state.block_table) * block_size < starts[i] + n:
                raise ValueError(
                    f"step {step.step_id}: request {rid} needs {starts[i] + n} token slots, "
                    f"its block table holds {len(state.block_table)} blocks of {block_size}"
                )
            if decodes[i]:
                decode_slots.append(token_cursor)
                decode_inputs.append(self._decode_input(state, step.step_id))
                if n > 1 and decodes[i] == 2:  # the draft model fills these in later
                    input_ids[token_cursor + 1 : token_cursor + n] = 0
                    verify[i] = [0] * (n - 1)
                    drafted.append(DraftSlot(i, state, starts[i], n - 1, token_cursor + 1))
                elif n > 1:  # a verify entry: its drafts follow the last sampled token
                    drafts = arrays.prefill_ids[prefill_cursor : prefill_cursor + n - 1]
                    input_ids[token_cursor + 1 : token_cursor + n] = drafts
                    verify[i] = drafts.tolist()
                    prefill_cursor += n - 1
            else:
                chunk = arrays.prefill_ids[prefill_cursor : prefill_cursor + n]
                input_ids[token_cursor : token_cursor + n] = chunk
                prefill_cursor += n
                if state.images:
                    slices = image_slices(state.images, starts[i], n, token_cursor)
                    images += slices
                    if self.vision is not None and self.vision.bidirectional:
                        bidirectional += [(i, a - token_cursor, b - a) for a, b in row_runs(slices)]
            token_cursor += n
            states.append(state)
        input_ids[decode_slots] = decode_inputs
        if self.vocab_size is not None and (images or verify):
            input_ids[input_ids >= self.vocab_size] = 0  # image ids, or drafts copied from them

        ends = np.cumsum(arrays.num_tokens)
        # position of token t of entry i: start_pos[i] + t
        shifts = np.repeat(arrays.start_pos - (ends - arrays.num_tokens), arrays.num_tokens)
        positions = np.arange(len(input_ids), dtype=np.int64) + shifts
        sample_index = ends[arrays.sample] - 1
        rows_per_entry = arrays.sample
        if verify:
            sample_index, rows_per_entry = _verify_rows(arrays, ends)
        batch = ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            start_pos=starts,
            num_tokens=counts,
            block_tables=[s.block_table for s in states],
            sample_index=torch.from_numpy(sample_index).to(self.device),
            bidirectional=bidirectional,
        )
        if self.mrope:
            batch.rope_positions = _rope_positions(states, positions, counts).to(self.device)
        samples = arrays.sample.tolist()
        sampling = [s for s, wants in zip(states, samples, strict=True) if wants]
        pooling = None
        if self.pooling:
            pooling = PoolingRows.of(states, starts, counts, rows_per_entry.tolist())
        if pooling is not None:
            batch.hidden_index = pooling.hidden_tensor(self.device)
        if verify:  # keyed by sampling entry: the index among the entries that sample
            sampling_index = np.cumsum(arrays.sample) - 1
            verify = {int(sampling_index[i]): drafts for i, drafts in verify.items()}
            for slot in drafted:
                slot.entry = int(sampling_index[slot.entry])
        return PreparedStep(
            step.step_id, batch, sampling, step.dropped, pooling, verify, drafted, images
        )

    def _settle_chained(self, arrays: StepArrays, step_id: int) -> StepArrays:
        """The step's arrays with each chained entry (is_decode 3) made the entry it runs as.

        The request's last sampled token sits at position ``prompt + output - 1`` (a prefill
        samples the token after its last position, each reported token follows the one before,
        and a recompute after a retraction prefills prompt + output, then samples the next).
        There: the entry runs as sent, a kind-1 entry. Below (its verify accepted fewer than all
        its drafts): a plain 1-token decode at that position, its drafts dropped from the input
        ids. Above: a malformed step. A finished request's entry runs as sent: its tokens are
        discarded anyway.
        """
        kinds = arrays.decode_kind
        starts = arrays.start_pos.tolist()
        counts = arrays.num_tokens.tolist()
        # where each entry's ids begin in input_ids: prefill tokens, or drafts after the held token
        sent = np.where(kinds == 0, arrays.num_tokens, (kinds != 2) * (arrays.num_tokens - 1))
        first = (np.cumsum(sent) - sent).tolist()
        keep: np.ndarray | None = None  # input ids still used, once a chained entry drops some
        rids, requests = arrays.rids.tolist(), self._requests
        for i in np.flatnonzero(kinds == 3).tolist():
            state = requests.get(rids[i])
            if state is None or state.finished:
                continue  # unknown: refused by _prepare; finished: its tokens are discarded
            actual = len(state.prompt_ids) + len(state.output_ids) - 1
            if actual == starts[i]:
                continue
            if actual > starts[i]:
                raise ValueError(
                    f"step {step_id}: chained entry for request {rids[i]} starts at "
                    f"{starts[i]}, before its last sampled token at position {actual}"
                )
            if counts[i] > 1:
                if keep is None:
                    keep = np.ones(len(arrays.prefill_ids), dtype=bool)
                keep[first[i] : first[i] + counts[i] - 1] = False
            starts[i], counts[i] = actual, 1
        kinds = np.where(kinds == 3, np.uint8(1), kinds)
        return replace(
            arrays,
            start_pos=np.asarray(starts, dtype=np.int64),
            num_tokens=np.asarray(counts, dtype=np.int64),
            decode_kind=kinds,
            prefill_ids=arrays.prefill_ids if keep is None else arrays.prefill_ids[keep],
            top_kind=int(kinds.max(initial=0)),
        )

    @staticmethod
    def _decode_input(state: RequestState, step_id: int) -> int:
        if state.last_token is None and state.finished:
            return 0  # rejected or failed before sampling: its output is discarded anyway
        if state.last_token is None:
            raise ValueError(
                f"step {step_id}: decode entry for request {state.rid}, "
                "which has sampled no token yet"
            )
        return state.last_token

    def record(
        self,
        prepared: PreparedStep,
        out: SampleOutput | None,
        forward_ms: float,
        verified: dict[int, VerifyOutput] | None = None,
    ) -> StepTokens:
        """Appends sampled tokens, decides EOS/length finishes, and builds the StepTokens.

        ``out`` has one row per plain sampling entry; ``verified`` the results of the verify
        entries, by sampling entry index (then ``out`` covers the other entries, in order).
        """
        if verified:
            return self._record_verified(prepared, out, forward_ms, verified)
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
            # ``_append``, inlined: a call per entry is measurable on 256-entry decode steps
            state.output_ids.append(token)
            finish = self._finish_code(state, token)
            if state.grammar is not None and finish == FINISH_NONE:
                assert self.grammars is not None
                if self.grammars.advance(state.grammar, token):
                    finish = FINISH_GRAMMAR_ERROR if state.grammar.failed else FINISH_GRAMMAR
            state.finished = finish != FINISH_NONE
            if out.logprobs is not None:
                logprobs.append(out.logprobs[row])
            if out.top_logprobs is not None and out.top_logprobs[row] is not None:
                tops.append(_top_logprobs(len(rids), out.top_logprobs[row]))
            rids.append(state.rid)
            tokens.append(token)
            finishes.append(finish)
        return _step_tokens(prepared, rids, tokens, finishes, logprobs, tops, forward_ms)

    def _record_verified(
        self,
        prepared: PreparedStep,
        out: SampleOutput | None,
        forward_ms: float,
        verified: dict[int, VerifyOutput],
    ) -> StepTokens:
        """``record`` for a step with verify entries: one of them emits its tokens one by one,
        each reported with the rid, until the first that finishes the request."""
        rids: list[int] = []
        tokens: list[int] = []
        finishes: list[int] = []
        logprobs: list[float | None] = []
        tops: list[TopLogprobs] = []
        row = 0  # of ``out``: the plain entries, in order
        for entry, state in enumerate(prepared.sampling):
            result = verified.get(entry)
            if result is None:
                assert out is not None
                emitted = [out.token_ids[row]]
                entry_logprobs = [out.logprobs[row]] if out.logprobs is not None else None
                entry_tops = [out.top_logprobs[row]] if out.top_logprobs is not None else None
                row += 1
            else:
                emitted = result.token_ids
                entry_logprobs, entry_tops = result.logprobs, result.top_logprobs
            if state.finished:
                state.last_token = emitted[-1]
                continue  # finished at an earlier step, or dropped: the scheduler ran ahead
            for j, token in enumerate(emitted):
                state.last_token = token
                finish = self._append(state, token)
                logprobs.append(entry_logprobs[j] if entry_logprobs is not None else None)
                top = entry_tops[j] if entry_tops is not None else None
                if top is not None:
                    tops.append(_top_logprobs(len(rids), top))
                rids.append(state.rid)
                tokens.append(token)
                finishes.append(finish)
                if finish != FINISH_NONE:
                    break  # tokens after a finish are never reported
        # one logprob per reported token once any request asked (the others' go unread)
        filled = [float("nan") if v is None else v for v in logprobs]
        if all(v is None for v in logprobs):
            filled = []
        return _step_tokens(prepared, rids, tokens, finishes, filled, tops, forward_ms)

    def _append(self, state: RequestState, token: int) -> int:
        """Appends one output token; returns its finish code (and marks the state finished)."""
        state.output_ids.append(token)
        finish = self._finish_code(state, token)
        if state.grammar is not None and finish == FINISH_NONE:
            assert self.grammars is not None
            if self.grammars.advance(state.grammar, token):
                finish = FINISH_GRAMMAR_ERROR if state.grammar.failed else FINISH_GRAMMAR
        state.finished = finish != FINISH_NONE
        return finish

    def _finish_code(self, state: RequestState, token: int) -> int:
        params = state.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return FINISH_STOP
        if len(state.output_ids) >= params.max_new_tokens:
            return FINISH_LENGTH
        return FINISH_NONE


def _grid(item: RequestImage) -> tuple[int, int, int]:
    """An image's patch grid (t, h, w), as Qwen2.5-VL's image processor reports it."""
    grid = item.image.tensors.get("image_grid_thw")
    if grid is None:
        raise ValueError("an image without image_grid_thw for multimodal rope")
    t, h, w = np.frombuffer(grid.data, dtype=np.dtype(grid.dtype)).reshape(-1)[:3].tolist()
    return int(t), int(h), int(w)


def _rope_positions(
    states: list[RequestState], positions: np.ndarray, counts: list[int]
) -> torch.Tensor:
    """int64 [3, T]: each row's rope positions: its cache position, but for requests with
    multimodal rope the prompt's own (mrope.py) and past it the position plus the delta."""
    out = np.broadcast_to(positions, (3, positions.size)).copy()
    at = 0
    for state, n in zip(states, counts, strict=True):
        table = state.rope_positions
        if table is not None:
            rows = positions[at : at + n]
            inside = rows < table.shape[1]
            out[:, at : at + n] = np.where(
                inside, table[:, np.minimum(rows, table.shape[1] - 1)], rows + state.rope_delta
            )
        at += n
    return torch.from_numpy(out)


def _top_logprobs(index: int, top: tuple[list[int], list[float]]) -> TopLogprobs:
    top_ids, top_values = top
    return TopLogprobs(
        index=index,
        token_ids=np.asarray(top_ids, dtype="<i4").tobytes(),
        logprobs=np.asarray(top_values, dtype="<f4").tobytes(),
    )


def _step_tokens(
    prepared: PreparedStep,
    rids: list[int],
    tokens: list[int],
    finishes: list[int],
    logprobs: list[float],
    tops: list[TopLogprobs],
    forward_ms: float,
) -> StepTokens:
    return StepTokens(
        step_id=prepared.step_id,
        rids=np.asarray(rids, dtype="<i8").tobytes(),
        token_ids=np.asarray(tokens, dtype="<i4").tobytes(),
        finish=np.asarray(finishes, dtype=np.uint8).tobytes(),
        dropped=prepared.dropped,
        logprobs=np.asarray(logprobs, dtype="<f4").tobytes() if logprobs else b"",
        top_logprobs=tops,
        forward_ms=forward_ms,
        computed_tokens=prepared.batch.input_ids.numel(),
    )


def _verify_rows(arrays: StepArrays, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The logits rows of a step with verify entries: every position of a verify entry, the
    last token of any other sampling entry; and the number of rows of each entry."""
    verifying = arrays.is_decode & (arrays.num_tokens > 1)
    rows = np.where(verifying, arrays.num_tokens, 1) * arrays.sample
    first = np.repeat(ends - rows, rows)  # the first row of each entry, once per row
    within = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
    return first + within, rows


def _update_block_table(
    state: RequestState, offset: int, new_ids: np.ndarray, block_size: int
) -> None:
    """Block ids for positions from ``offset * block_size`` on; offset 0 replaces the table."""
    if len(new_ids) == 0:
        return  # nothing new (every entry computes ≥ 1 token, so an empty table never fits)
    table = state.block_table
    if offset > len(table) or offset < 0:
        raise ValueError(
            f"request {state.rid}: block entries start at {offset}, "
            f"but its block table has {len(table)} entries"
        )
    if offset < len(table):  # the draft model's K/V past ``offset`` lay in the blocks replaced
        state.draft_computed = min(state.draft_computed, offset * block_size)
    del table[offset:]  # offset 0 replaces the table (admission, recompute after retraction)
    table.extend(new_ids.tolist())


@dataclass
class StepArrays:
    """A Step's packed arrays as numpy arrays, checked for consistent lengths."""

    rids: np.ndarray  # int64 per entry
    start_pos: np.ndarray  # int64 per entry
    num_tokens: np.ndarray  # int64 per entry
    is_decode: np.ndarray  # bool per entry
    # uint8 per entry: 0 not a decode, 1 a decode, 2 worker-drafted, 3 chained (see
    # RequestTable._settle_chained, after which none is left)
    decode_kind: np.ndarray
    sample: np.ndarray  # bool per entry
    block_offsets: np.ndarray  # int32 per entry
    block_counts: np.ndarray  # int32 per entry
    block_ids: np.ndarray  # int32, concatenated
    prefill_ids: np.ndarray  # int32, concatenated
    top_kind: int = 0  # the largest decode kind: 0 when no entry decodes

    @classmethod
    def of(cls, step: Step) -> StepArrays:
        arrays = cls(
            rids=np.frombuffer(step.rids, dtype="<i8"),
            start_pos=np.frombuffer(step.start_pos, dtype="<i4").astype(np.int64),
            num_tokens=np.frombuffer(step.num_tokens, dtype="<i4").astype(np.int64),
            is_decode=np.frombuffer(step.is_decode, dtype=np.uint8).astype(bool),
            decode_kind=np.frombuffer(step.is_decode, dtype=np.uint8),
            sample=np.frombuffer(step.sample, dtype=np.uint8).astype(bool),
            block_offsets=np.frombuffer(step.block_offsets, dtype="<i4"),
            block_counts=np.frombuffer(step.block_counts, dtype="<i4"),
            block_ids=np.frombuffer(step.block_ids, dtype="<i4"),
            prefill_ids=np.frombuffer(step.input_ids, dtype="<i4"),
        )
        arrays.check(step.step_id)
        return arrays

    def check(self, step_id: int) -> None:
        entries = len(self.rids)
        per_entry = ("start_pos", "num_tokens", "is_decode", "sample")
        per_entry += ("block_offsets", "block_counts")
        for name in per_entry:
            if len(getattr(self, name)) != entries:
                got = len(getattr(self, name))
                raise ValueError(f"step {step_id}: {got} {name} for {entries} entries")
        if (self.num_tokens < 1).any() or (self.start_pos < 0).any():
            raise ValueError(f"step {step_id}: an empty entry or a negative start position")
        top_kind = self.top_kind = int(self.decode_kind.max(initial=0))
        if top_kind > 3:
            raise ValueError(f"step {step_id}: is_decode {top_kind} (0, 1, 2 or 3 expected)")
        if top_kind == 3 and not self.sample[self.decode_kind == 3].all():
            raise ValueError(f"step {step_id}: a chained entry that does not sample")
        if (self.block_counts < 0).any():
            raise ValueError(f"step {step_id}: a negative block count")
        if (~self.sample & self.is_decode & (self.num_tokens > 1)).any():
            raise ValueError(f"step {step_id}: a verify entry that does not sample")
        if int(self.block_counts.sum()) != len(self.block_ids):
            raise ValueError(
                f"step {step_id}: {len(self.block_ids)} block ids, "
                f"entries say {self.block_counts.sum()}"
            )
        # a decode's first input is the worker's; a verify entry's drafts travel with the step
        # (also a chained entry's, used or not), unless the worker drafts them (is_decode 2)
        prefill_tokens = int(self.num_tokens.sum()) - int(self.is_decode.sum())
        if top_kind >= 2:
            worker_drafted = self.decode_kind == 2
            prefill_tokens -= int((self.num_tokens[worker_drafted] - 1).sum())
        if prefill_tokens != len(self.prefill_ids):
            raise ValueError(
                f"step {step_id}: {len(self.prefill_ids)} prefill input ids and drafts, "
                f"entries say {prefill_tokens}"
            )
