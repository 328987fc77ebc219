"""Property tests of the C++ scheduling core ``pyserve._core`` (issue 2, section 4).

Two hypothesis state machines:

- ``CacheMachine`` drives ``RadixCache`` + ``BlockAllocator`` and the pure-Python reference
  (``core_reference``) with the same calls and demands identical answers: prefix matches and
  their block ids, duplicate counts on insert, evictions, statistics, refcounts.
- ``PlannerMachine`` drives a ``Planner`` through random interleavings of add / plan / report
  (up to two steps in flight) / finish / abort / evict / flush, and of speculative decoding:
  random drafts, reports that accept any number of them (none to all), aborts while drafts are
  being verified. Requests carry random whole spans (at position 0, touching, longer than a
  chunk or the step's budget, holding the end of a cached prefix): no prefill entry may end
  strictly inside one, and only a chunk that completes a span may pass the budgets. It plays
  the worker itself: it
  keeps every request's block table as the worker would and a shadow of the KV pool that
  records which (request, position) wrote each slot. From that it checks what the worker
  relies on: a step reads only slots that hold the KV of exactly the tokens it expects, writes
  only blocks nobody else uses, and the cache maps every token prefix to blocks whose content
  is that prefix. The shadow's cached blocks give the reference answer for ``match_prefix``.
  After the random run it drives the planner to completion (every request must finish: no
  starvation, no deadlock), flushes the cache and demands that every block is free.

The same planner machine also runs against the reference planner, which checks the harness
itself and keeps the benchmark's baseline honest. ``LockstepMachine`` drives the core and the
reference with the same calls (radix cache off) and demands identical Steps and answers.
"""

from __future__ import annotations

import itertools
import math
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import core_reference as reference
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pyserve import _core as core

FREE, OWNED, CACHED = reference.FREE, reference.OWNED, reference.CACHED
VOCAB = 50  # token ids in tests; outputs come from a smaller range so sequences collide
MAX_INFLIGHT = 2
TAILS = st.lists(st.integers(0, 7), max_size=12)  # prompt tails and outputs share a small range


class CoreViolation(AssertionError):
    """An invariant of the core failed; the message names the operation and the invariant."""


def _i32(data: bytes) -> list[int]:
    return array("i", data).tolist()


def _i64(data: bytes) -> list[int]:
    return array("q", data).tolist()


def _block_ids(blocks: bytes | list[int]) -> list[int]:
    """Block ids as a list: the core returns them as packed int32 bytes, the reference as a list."""
    return _i32(blocks) if isinstance(blocks, bytes) else list(blocks)


def _draw_spans(draw, length: int) -> list[int]:
    """Random whole spans (flat [start, end) pairs) over a prompt of ``length`` positions: cuts
    at random positions (0 and the prompt's end included now and then), each gap between two
    cuts a span or not, so spans may start at 0, touch each other, outgrow chunked_prefill_size
    and the prefill budget, and hold the end of a cached prefix."""
    if length == 0 or draw(st.integers(0, 2), "spans?") == 0:
        return []
    cuts = sorted(set(draw(st.lists(st.integers(0, length), min_size=2, max_size=8), "cuts")))
    flat = []
    for start, end in itertools.pairwise(cuts):
        if draw(st.integers(0, 2), "span?"):
            flat += [start, end]
    return flat


def _span_pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _prefix_hashes(tokens: list[int]) -> list[tuple[int, int]]:
    """hashes[k] identifies tokens[:k] (length and content)."""
    out, h = [(0, 0)], 0
    for k, t in enumerate(tokens, 1):
        h = hash((h, t))
        out.append((k, h))
    return out


# --------------------------------------------------------------------------------------------
# RadixCache + BlockAllocator against the reference, call for call


class CacheMachine(RuleBasedStateMachine):
    """Identical calls on the core and the reference must give identical answers."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 40),
        prefixes=st.lists(st.lists(st.integers(0, 5), max_size=24), min_size=1, max_size=3),
        whole_edge_compare=st.booleans(),
        disk_budget=st.sampled_from([0, 3, 12]),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        prefixes: list[list[int]],
        whole_edge_compare: bool,
        disk_budget: int,
    ) -> None:
        self.bs = block_size
        self.prefixes = prefixes
        self.core_alloc = core.BlockAllocator(num_blocks)
        self.core_cache = core.RadixCache(block_size, self.core_alloc)
        self.ref_alloc = reference.BlockAllocator(num_blocks)
        self.ref_cache = reference.RadixCache(block_size, self.ref_alloc)
        self.ref_cache.whole_edge_compare = whole_edge_compare  # both ways of matching agree
        self.core_cache.set_disk_budget(disk_budget)
        self.ref_cache.set_disk_budget(disk_budget)
        self.locks: list[tuple[int, int, list[int]]] = []  # (core handle, ref handle, blocks)
        self.seen: list[list[int]] = [list(p) for p in prefixes]
        # The core names a disk block by a 64-bit hash, the reference by its token prefix: the
        # names must correspond one to one.
        self.core_to_ref: dict[int, tuple] = {}
        self.ref_to_core: dict[tuple, int] = {}

    def _same_key(self, core_key: int, ref_key: tuple) -> None:
        if self.core_to_ref.setdefault(core_key, ref_key) != ref_key:
            self._fail(f"core key {core_key} names {self.core_to_ref[core_key]} and {ref_key}")
        if self.ref_to_core.setdefault(ref_key, core_key) != core_key:
            self._fail(f"prefix {ref_key} has core keys {self.ref_to_core[ref_key]}, {core_key}")

    def _same_ops(self, what: str, core_ops: list, ref_ops: list) -> None:
        if [b for b, _ in core_ops] != [b for b, _ in ref_ops]:
            self._fail(f"{what}: core blocks {core_ops}, reference {ref_ops}")
        for (_, core_key), (_, ref_key) in zip(core_ops, ref_ops, strict=True):
            self._same_key(core_key, ref_key)

    def _sequence(self, data: st.DataObject) -> list[int]:
        prefix = data.draw(st.sampled_from(self.prefixes))
        cut = data.draw(st.integers(0, len(prefix)))
        tail = data.draw(st.lists(st.integers(0, 5), max_size=3 * self.bs))
        return prefix[:cut] + tail

    def _fail(self, what: str) -> None:
        raise CoreViolation(what)

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = self._sequence(data)
        n = len(tokens) // self.bs
        if n > self.core_alloc.num_free:
            return
        ids = _i32(self.core_alloc.allocate(n))
        self.ref_alloc.take(ids)  # the reference must agree that these blocks were free
        as_bytes = data.draw(st.booleans())
        core_args = (
            array("i", tokens).tobytes() if as_bytes else tokens,
            array("i", ids).tobytes() if as_bytes else ids,
        )
        if data.draw(st.booleans()):
            core_hit, core_loads = self.core_cache.insert_with_loads(*core_args)
            ref_hit, ref_loads = self.ref_cache.insert_with_loads(tokens, ids)
            self._same_ops(f"insert({tokens}) loads", core_loads, ref_loads)
        else:
            core_hit = self.core_cache.insert(*core_args)
            ref_hit = self.ref_cache.insert(tokens, ids)
        if core_hit != ref_hit:
            self._fail(f"insert({tokens}): core says {core_hit} cached, reference {ref_hit}")
        # The caller drops its own references: duplicates become free, adopted ones stay.
        self.core_alloc.decref(ids)
        self.ref_alloc.decref(ids)
        self.seen.append(tokens)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(self.seen)) if data.draw(st.booleans()) else None
        tokens = tokens if tokens is not None else self._sequence(data)
        self._compare_match(tokens)

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(self.seen))
        _, blocks, core_handle = self.core_cache.match_prefix(tokens)
        _, _, ref_handle = self.ref_cache.match_prefix(tokens)
        self.core_cache.lock(core_handle)
        self.ref_cache.lock(ref_handle)
        self.locks.append((core_handle, ref_handle, _i32(blocks)))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        core_handle, ref_handle, _ = self.locks.pop(i)
        self.core_cache.unlock(core_handle)
        self.ref_cache.unlock(ref_handle)

    @precondition(lambda self: not self.locks)
    @rule(data=st.data())
    def unlock_unlocked_raises(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(self.seen))
        _, _, core_handle = self.core_cache.match_prefix(tokens)
        _, _, ref_handle = self.ref_cache.match_prefix(tokens)
        for cache, handle in ((self.core_cache, core_handle), (self.ref_cache, ref_handle)):
            if handle != 0:  # the root is never evicted; unlocking it is harmless
                with pytest.raises(ValueError):
                    cache.unlock(handle)

    @rule(data=st.data())
    def insert_free_block_raises(self, data: st.DataObject) -> None:
        """Adopting a block that holds no KV (a free one) is refused and changes nothing."""
        tokens = data.draw(st.sampled_from(self.seen)) + [6] * self.bs  # 6: never cached
        n = len(tokens) // self.bs
        if n > self.core_alloc.num_free:
            return
        ids = _i32(self.core_alloc.allocate(n - 1))  # good blocks for all but the last block
        free = [b for b in range(self.core_alloc.num_blocks) if self.core_alloc.refcount(b) == 0]
        bad = [*ids, data.draw(st.sampled_from(free))]
        as_bytes = data.draw(st.booleans())
        with pytest.raises(ValueError):
            self.core_cache.insert(
                array("i", tokens).tobytes() if as_bytes else tokens,
                array("i", bad).tobytes() if as_bytes else bad,
            )
        self.core_alloc.decref(ids)

    @rule(n=st.integers(0, 12), take=st.booleans())
    def evict(self, n: int, take: bool) -> None:
        core_released = self.core_cache.evict(n)
        ref_released = self.ref_cache.evict(n)
        if core_released != ref_released:
            self._fail(f"evict({n}) released {core_released} blocks, reference {ref_released}")
        if take:  # as the planner does before the blocks are reused
            self.take_ops()

    @rule(budget=st.integers(0, 16))
    def set_disk_budget(self, budget: int) -> None:
        self.core_cache.set_disk_budget(budget)
        self.ref_cache.set_disk_budget(budget)

    @rule(data=st.data())
    def insert_disk(self, data: st.DataObject) -> None:
        """What a restart finds on disk joins the tree as disk nodes."""
        tokens = self._sequence(data)
        core_added = self.core_cache.insert_disk(tokens)
        ref_added = self.ref_cache.insert_disk(tokens)
        if core_added != ref_added:
            self._fail(f"insert_disk({tokens}) added {core_added} blocks, reference {ref_added}")
        self.seen.append(tokens)

    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(self.seen))
        core_peek = self.core_cache.peek_prefix(tokens)
        ref_peek = self.ref_cache.peek_prefix(tokens)
        if core_peek != ref_peek:
            self._fail(f"peek_prefix({tokens}) = {core_peek}, reference {ref_peek}")

    @rule()
    def take_ops(self) -> None:
        self._same_ops("take_saves", self.core_cache.take_saves(), self.ref_cache.take_saves())
        core_drops, ref_drops = self.core_cache.take_drops(), self.ref_cache.take_drops()
        if len(core_drops) != len(ref_drops):
            self._fail(f"take_drops: core {core_drops}, reference {ref_drops}")
        for core_key, ref_key in zip(core_drops, ref_drops, strict=True):
            self._same_key(core_key, ref_key)

    @rule(data=st.data())
    def block_keys(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(self.seen))
        keys = self.core_cache.block_keys(tokens)
        if len(keys) != len(tokens) // self.bs:
            self._fail(f"block_keys({tokens}) gave {len(keys)} keys")
        for i, key in enumerate(keys):
            self._same_key(key, tuple(tokens[: (i + 1) * self.bs]))

    @rule()
    def reset(self) -> None:
        core_released = self.core_cache.reset()
        ref_released = self.ref_cache.reset()
        if core_released != ref_released:
            self._fail(f"reset() released {core_released} blocks, reference {ref_released}")

    def _compare_match(self, tokens: list[int]) -> None:
        core_n, packed, _ = self.core_cache.match_prefix(tokens)
        ref_n, ref_blocks, _ = self.ref_cache.match_prefix(tokens)
        if not isinstance(packed, bytes):
            self._fail(f"match_prefix returned block ids as {type(packed).__name__}, not bytes")
        core_blocks = _i32(packed)
        if (core_n, core_blocks) != (ref_n, ref_blocks):
            self._fail(
                f"match_prefix({tokens}) = {core_n}, {core_blocks}; reference {ref_n}, {ref_blocks}"
            )
        if core_n != len(core_blocks) * self.bs:
            self._fail(f"match_prefix: {core_n} tokens but {len(core_blocks)} blocks")

    @invariant()
    def agrees_with_reference(self) -> None:
        if not hasattr(self, "core_cache"):
            return
        self.core_cache.check_invariants()
        core_stats, ref_stats = self.core_cache.stats(), self.ref_cache.stats()
        for key, value in ref_stats.items():
            if core_stats.get(key) != value:
                self._fail(f"stats[{key!r}] = {core_stats.get(key)}, reference {value}")
        if self.core_cache.cached_blocks != ref_stats["cached_blocks"]:
            self._fail("cached_blocks property disagrees with stats()")
        if self.core_cache.evictable_blocks != ref_stats["evictable_blocks"]:
            self._fail("evictable_blocks property disagrees with stats()")
        if self.core_alloc.num_free != self.ref_alloc.num_free:
            self._fail(f"num_free {self.core_alloc.num_free}, reference {self.ref_alloc.num_free}")
        for b in range(self.core_alloc.num_blocks):
            if self.core_alloc.refcount(b) != self.ref_alloc.refcount(b):
                self._fail(
                    f"refcount({b}) = {self.core_alloc.refcount(b)}, "
                    f"reference {self.ref_alloc.refcount(b)}"
                )
        cached = self.ref_cache.cached_block_ids()
        for _, _, blocks in self.locks:  # nothing locked is ever evicted
            # Callers dropped their references after insert: the tree is the only holder.
            gone = [b for b in blocks if b not in cached or self.core_alloc.refcount(b) == 0]
            if gone:
                self._fail(f"locked blocks {gone} left the cache")


TestRadixCacheAgainstReference = CacheMachine.TestCase
TestRadixCacheAgainstReference.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --------------------------------------------------------------------------------------------
# The planner, checked through what a worker would see


@dataclass
class Tracked:
    """The harness's view of one request: what the core must know, and the worker's table."""

    rid: int
    prompt: list[int]
    max_new: int
    arrival: int
    known: list[int] = field(default_factory=list)  # prompt + outputs the core accepted
    hashes: list[tuple[int, int]] = field(default_factory=list)
    state: str = "waiting"  # waiting | running | retracted | done
    admitted: bool = False
    samples: int = 0  # sampling entries emitted for it (each yields one output token)
    table: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions in its KV for the current admission
    prefix_blocks: list[int] = field(default_factory=list)  # cache blocks it reads from
    inflight: int = 0
    admit_seq: int = -1  # order of its latest admission
    prefill_done: bool = False  # its latest admission's last prefill chunk was planned
    computed: int = 0  # positions of its current admission computed by reported steps
    cached_tokens: int = -1  # prefix hit at its first admission
    match_prefix: bool = True  # False: every admission starts at position 0
    draft: list[int] = field(default_factory=list)  # set for the next plan()
    verifying: list[int] = field(default_factory=list)  # drafts of an unreported verify entry
    # speculative_chain: (step id, start, drafts) of the entry chained behind that verify entry
    chained: tuple[int, int, list[int]] | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)  # whole spans [start, end)
    priority: int = 0  # lower runs first (the priority policy)
    tenant: int = 0  # whose request (tenant fairness)
    served_to: int = 0  # its positions below this were counted served to its tenant

    def __post_init__(self) -> None:
        self.known = list(self.prompt)
        self.hashes = _prefix_hashes(self.known)

    def append(self, token: int) -> None:
        self.known.append(token)
        self.hashes.append((len(self.known), hash((self.hashes[-1][1], token))))

    @property
    def output_len(self) -> int:
        return len(self.known) - len(self.prompt)


@dataclass
class PlannedEntry:
    rid: int
    start: int
    n: int
    decode: bool
    worker_drafts: bool  # a verify entry whose drafts the worker's draft model writes
    chained: bool  # planned behind its request's unreported verify entry (is_decode 3)
    sample: bool
    offset: int
    blocks: list[int]
    input_ids: list[int]


def _entries(step) -> list[PlannedEntry]:
    rids, starts, counts = _i64(step.rids), _i32(step.start_pos), _i32(step.num_tokens)
    decode, sample = bytes(step.is_decode), bytes(step.sample)
    offsets, nblocks = _i32(step.block_offsets), _i32(step.block_counts)
    ids, tokens = _i32(step.block_ids), _i32(step.input_ids)
    sizes = {len(rids), len(starts), len(counts), len(decode), len(sample), len(offsets)}
    if sizes != {step.num_requests} or len(nblocks) != step.num_requests:
        raise CoreViolation(f"step {step.step_id}: per-entry arrays of different lengths")
    out, b, t = [], 0, 0
    for i, rid in enumerate(rids):
        # a decode's inputs are its drafts (none here when the worker's draft model writes them)
        n_in = 0 if decode[i] == 2 else counts[i] - 1 if decode[i] else counts[i]
        out.append(
            PlannedEntry(
                rid=rid,
                start=starts[i],
                n=counts[i],
                decode=bool(decode[i]),
                worker_drafts=decode[i] == 2,
                chained=decode[i] == 3,
                sample=bool(sample[i]),
                offset=offsets[i],
                blocks=ids[b : b + nblocks[i]],
                input_ids=tokens[t : t + n_in],
            )
        )
        b += nblocks[i]
        t += n_in
    if b != len(ids) or t != len(tokens):
        raise CoreViolation(f"step {step.step_id}: block_ids/input_ids lengths do not add up")
    return out


@st.composite
def planner_configs(draw) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    pool_tokens = draw(st.integers(16, 128))  # tight: prompts reach ~60 tokens with outputs
    policy = draw(st.sampled_from(["fcfs", "lpm", "priority"]))
    radix = draw(st.sampled_from([True, True, True, False]))
    return dict(
        tenant_fairness=policy == "fcfs" and draw(st.booleans()),
        fairness_quantum=draw(st.sampled_from([0, 0, 3, 16, 4096])),
        num_blocks=-(-pool_tokens // block_size),
        block_size=block_size,
        max_running_requests=draw(st.integers(1, 8)),
        max_prefill_tokens=draw(st.integers(1, 48)),
        chunked_prefill_size=draw(st.integers(1, 32)),
        policy=policy,
        enable_radix_cache=radix,
        vocab_size=VOCAB,
        init_reserve_ratio=draw(st.sampled_from([0.0, 0.0, 0.2, 0.7, 1.0])),
        min_reserve_ratio=0.0,
        reserve_decay=draw(st.sampled_from([0.0, 0.05, 0.3])),
        max_draft_tokens=draw(st.sampled_from([0, 1, 3, 5])),
        disk_budget_blocks=draw(st.sampled_from([0, 0, 4, 32])) if radix else 0,
    )


class PlannerMachine(RuleBasedStateMachine):
    impl = core  # the module providing Planner; the reference run overrides it

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.busy = False  # set while an operation runs, so teardown knows a step raised

    # -- set-up -------------------------------------------------------------------------------

    @initialize(
        config=planner_configs(),
        prefixes=st.lists(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), min_size=1, max_size=3
        ),
        seed=st.integers(0, 2**16),
        data=st.data(),
    )
    def setup(self, config: dict, prefixes: list[list[int]], seed: int, data) -> None:
        self.cfg = config
        self.bs = config["block_size"]
        self.num_blocks = config["num_blocks"]
        self.planner = self.impl.Planner(**config)
        self.prefixes = prefixes
        self.rng = random.Random(seed)
        self.requests: dict[int, Tracked] = {}
        self.next_rid = 1000
        self.inflight: list[tuple[int, list[int]]] = []  # (step id, rids that sample)
        self.next_step_id = 0
        self.to_drop: set[int] = set()  # finished/aborted since the last Step
        self.step_members: dict[int, dict[int, int]] = {}  # step id -> {rid: end of its entry}
        self.step_verify: dict[int, dict[int, tuple[int, int]]] = {}  # id -> {rid: (start, k)}
        self.admissions = 0
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * self.bs for _ in range(self.num_blocks)
        ]
        self.pending_reads: list[tuple[int, int, int, int]] = []  # (reader, writer, pos, step)
        self.disk: dict = {}  # the disk tier's files: key -> the block's slots when saved
        self.step_loads: dict[int, list[int]] = {}  # step id -> the blocks it loads
        self.op = "setup"
        self.ready = True
        self._check_all()
        for _ in range(data.draw(st.integers(1, 8), label="initial requests")):
            self.add(data, data.draw(st.integers(1, 10)), data.draw(TAILS))

    def _fail(self, what: str) -> None:
        raise CoreViolation(f"after {self.op}: {what}")

    @property
    def _by_priority(self) -> bool:
        return self.cfg["policy"] == "priority"

    def _begin(self, op: str) -> None:
        self.op, self.busy = op, True

    def _end(self) -> None:
        self._check_all()
        self.busy = False

    # -- rules --------------------------------------------------------------------------------

    @rule(data=st.data(), max_new=st.integers(1, 10), tail=TAILS)
    def add(self, data: st.DataObject, max_new: int, tail: list[int]) -> None:
        prefix = data.draw(st.sampled_from(self.prefixes))
        cut = len(prefix) if data.draw(st.booleans()) else data.draw(st.integers(0, len(prefix)))
        prompt = prefix[:cut] + tail
        rid = self.next_rid
        self.next_rid += 1
        # one request in four computes its whole prompt, reusing no cached prefix
        match_prefix = data.draw(st.integers(0, 3), label="match_prefix") > 0
        spans = _draw_spans(lambda s, label: data.draw(s, label=label), len(prompt))
        prio = data.draw(st.integers(-1, 2), label="priority") if self._by_priority else 0
        fair = self.cfg.get("tenant_fairness")
        tenant = data.draw(st.integers(0, 2), label="tenant") if fair else 0
        self._begin(
            f"add_request({rid}, len {len(prompt)}, max_new {max_new}, match_prefix={match_prefix}"
            f", whole_spans={_span_pairs(spans)}, priority={prio})"
        )
        fits = len(prompt) + max_new <= self.num_blocks * self.bs
        if not prompt or not fits:
            with pytest.raises(ValueError):
                self.planner.add_request(rid, prompt, max_new, whole_spans=spans)
        else:
            if data.draw(st.booleans()):
                packed, packed_spans = array("i", prompt).tobytes(), array("i", spans).tobytes()
                self.planner.add_request(
                    rid,
                    packed,
                    max_new,
                    match_prefix=match_prefix,
                    whole_spans=packed_spans,
                    priority=prio,
                    tenant=tenant,
                )
            else:
                self.planner.add_request(
                    rid,
                    prompt,
                    max_new,
                    match_prefix=match_prefix,
                    whole_spans=spans,
                    priority=prio,
                    tenant=tenant,
                )
            self.requests[rid] = Tracked(
                rid,
                prompt,
                max_new,
                arrival=len(self.requests),
                match_prefix=match_prefix,
                spans=_span_pairs(spans),
                priority=prio,
                tenant=tenant,
            )
            if spans:
                event("whole spans")
        self._end()

    @rule(data=st.data())
    def bad_calls(self, data: st.DataObject) -> None:
        """Each bad call is refused with the documented exception and changes nothing."""
        kind = data.draw(
            st.sampled_from(
                [
                    "duplicate",
                    "token",
                    "negative",
                    "max_new",
                    "report",
                    "report_rid",
                    "report_missing",
                    "finish",
                    "spans",
                    "priority",
                ]
            )
        )
        live = [rid for rid, r in self.requests.items() if r.state != "done"]
        live_samples = [
            rid for rid in (self.inflight[0][1] if self.inflight else []) if rid in live
        ]
        if (
            (kind == "duplicate" and not live)
            or (kind == "report_rid" and not self.inflight)
            or (kind == "report_missing" and not live_samples)
            or (kind == "priority" and self._by_priority)
        ):
            kind = "token"
        self._begin(f"bad call: {kind}")
        rid = live[0] if kind == "duplicate" else self.next_rid
        prompt, max_new = [1, 2, 3], 2
        if kind == "token":
            prompt = [1, VOCAB, 2]
        elif kind == "negative":
            prompt = [1, -1]
        elif kind == "max_new":
            max_new = data.draw(st.sampled_from([0, -3]))
        spans, prio = [], 0
        if kind == "priority":  # a priority under a policy that ignores priorities
            prio = data.draw(st.sampled_from([-1, 1]))
        if kind == "spans":  # odd length, empty, reversed, past the prompt, overlapping
            spans = data.draw(st.sampled_from([[1], [1, 1], [2, 1], [0, 4], [-1, 1], [0, 2, 1, 3]]))
        if kind == "report":  # a step that was never planned, or not the oldest in flight
            with pytest.raises(RuntimeError):
                self.planner.report(self.next_step_id + 5, [], [])
        elif kind == "report_rid":  # a rid that did not sample in that step, or twice
            step_id, rids = self.inflight[0]
            # named more often than it sampled: twice, or k + 2 times for a verify entry
            k = self.step_verify[step_id].get(rids[0], (0, 0))[1] if rids else 0
            bad = data.draw(
                st.sampled_from([[self.next_rid + 3], rids[:1] * (k + 2) if rids else [7]])
            )
            with pytest.raises(RuntimeError):
                self.planner.report(step_id, bad, [1] * len(bad))
        elif kind == "report_missing":  # a live request's sample left out
            step_id, rids = self.inflight[0]
            missing = data.draw(st.sampled_from(live_samples))
            rest = [rid for rid in rids if rid != missing]
            with pytest.raises(RuntimeError):
                self.planner.report(step_id, rest, [1] * len(rest))
        elif kind == "finish":  # a rid the planner never saw
            with pytest.raises(KeyError):
                self.planner.finish(self.next_rid + 11)
        else:
            with pytest.raises(ValueError):
                self.planner.add_request(rid, prompt, max_new, whole_spans=spans, priority=prio)
        self._end()

    @precondition(lambda self: self.ready and len(self.inflight) < MAX_INFLIGHT)
    @rule()
    def plan(self) -> None:
        self._begin(f"plan() with {len(self.inflight)} steps in flight")
        self._plan_once()
        self._end()

    @precondition(lambda self: self.ready and self.inflight)
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        step_id, rids = self.inflight[0]
        if data.draw(st.booleans()):  # the worker may leave out requests it already dropped
            rids = [rid for rid in rids if self.requests[rid].state != "done"]
        if data.draw(st.booleans()):  # any order
            rids = data.draw(st.permutations(rids))
        rids, tokens = self._samples(
            step_id,
            rids,
            lambda k: data.draw(st.integers(0, k), label="accepted drafts"),
            lambda: data.draw(st.integers(0, 7), label="token"),
        )
        self._begin(f"report(step {step_id}, rids {rids}, tokens {tokens})")
        self._report(step_id, rids, tokens, as_bytes=data.draw(st.booleans()))
        self._end()

    @precondition(lambda self: self.ready)
    @rule(cycles=st.integers(1, 8))
    def advance(self, cycles: int) -> None:
        """Runs the engine loop for a while: keep two steps in flight, report the oldest."""
        for _ in range(cycles):
            self._draft_some()
            self._begin(f"advance: plan() with {len(self.inflight)} in flight")
            step = self._plan_once() if len(self.inflight) < MAX_INFLIGHT else None
            self._end()
            if step is None and not self.inflight:
                return
            if step is None or len(self.inflight) == MAX_INFLIGHT:
                step_id, rids = self.inflight[0]
                rids, tokens = self._random_samples(step_id, rids)
                self._begin(f"advance: report(step {step_id}, rids {rids}, tokens {tokens})")
                self._report(step_id, rids, tokens)
                self._end()

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        live = [r for r in self.requests.values() if r.state != "done" and r.output_len > 0]
        if not live:
            return
        req = data.draw(st.sampled_from(live))
        self._begin(f"finish({req.rid})")
        self.planner.finish(req.rid)
        self._close(req)
        with pytest.raises(KeyError):
            self.planner.finish(req.rid)
        self._end()

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        choices = [*self.requests, self.next_rid + 7]
        rid = data.draw(st.sampled_from(choices))
        req = self.requests.get(rid)
        self._begin(f"abort({rid})")
        expected = req is not None and req.state != "done"
        if self.planner.abort(rid) != expected:
            self._fail(f"abort({rid}) returned {not expected}, expected {expected}")
        if expected:
            self._close(req)
        self._end()

    @rule(data=st.data())
    def draft(self, data: st.DataObject) -> None:
        """Drafts for a decoding request, or a draft the planner must refuse."""
        k_max = self.cfg["max_draft_tokens"]
        fits = [
            r
            for r in self.requests.values()
            if r.state == "running"
            and r.prefill_done
            and not r.verifying
            and min(k_max, r.max_new - r.samples - 1) >= 1
        ]
        if not fits or data.draw(st.integers(0, 5), label="bad draft") == 0:
            kind = data.draw(st.sampled_from(["unknown", "waiting", "verifying", "long", "token"]))
            waiting = [r for r in self.requests.values() if r.state in ("waiting", "retracted")]
            verifying = [r for r in self.requests.values() if r.verifying and r.state != "done"]
            self._begin(f"bad set_draft: {kind}")
            if kind == "waiting" and waiting:
                with pytest.raises(ValueError):
                    self.planner.set_draft(data.draw(st.sampled_from(waiting)).rid, [1])
            elif kind == "verifying" and verifying:
                with pytest.raises(ValueError):
                    self.planner.set_draft(data.draw(st.sampled_from(verifying)).rid, [1])
            elif kind == "long" and fits:
                req = data.draw(st.sampled_from(fits))
                k = max(k_max, req.max_new - req.samples - 1) + 1
                with pytest.raises(ValueError):
                    self.planner.set_draft(req.rid, [1] * k)
            elif kind == "token" and fits:
                with pytest.raises(ValueError):
                    self.planner.set_draft(data.draw(st.sampled_from(fits)).rid, [1, VOCAB])
            else:
                with pytest.raises(KeyError):
                    self.planner.set_draft(self.next_rid + 13, [1])
            self._end()
            return
        req = data.draw(st.sampled_from(fits))
        k = data.draw(st.integers(0, min(k_max, req.max_new - req.samples - 1)), label="k")
        tokens = data.draw(st.lists(st.integers(0, 7), min_size=k, max_size=k), label="draft")
        self._begin(f"set_draft({req.rid}, {tokens})")
        if data.draw(st.booleans()):
            self.planner.set_draft(req.rid, array("i", tokens).tobytes())
        else:
            self.planner.set_draft(req.rid, tokens)
        req.draft = tokens
        self._end()

    @rule(data=st.data())
    def abort_verifying(self, data: st.DataObject) -> None:
        """Aborts a request while a step verifying its drafts is unreported."""
        verifying = [r for r in self.requests.values() if r.verifying and r.state != "done"]
        if not verifying:
            return
        req = data.draw(st.sampled_from(verifying))
        self._begin(f"abort({req.rid}) mid-speculation")
        if not self.planner.abort(req.rid):
            self._fail(f"abort({req.rid}) of a running request returned False")
        self._close(req)
        self._end()

    @rule(n=st.integers(0, 200))
    def evict(self, n: int) -> None:
        self._begin(f"cache.evict({n})")
        self.planner.cache.evict(n)
        if n >= self.num_blocks and self.planner.cache.evictable_blocks != 0:
            self._fail("evict(everything) left evictable blocks in the cache")
        self._end()

    @rule()
    def flush(self) -> None:
        self._begin("flush_cache()")
        self.planner.flush_cache()
        if self.planner.cache.evictable_blocks != 0:
            self._fail("flush_cache() left evictable blocks in the cache")
        self._end()

    # -- driving the planner like the engine does ---------------------------------------------

    def _plan_once(self):
        stats = self.planner.stats()
        self.served_before = dict(stats["tenant_tokens"])
        self.fair_retractions_before = stats["fairness_retractions"]
        self.loading_before = {
            r.rid
            for r in self.requests.values()
            if self.cfg.get("tenant_fairness") and self._loading(r)
        }
        step = self.planner.plan()
        if step is None:
            if self.to_drop:
                self._fail(f"plan() returned None with {sorted(self.to_drop)} to drop")
            return None
        self._on_step(step)
        return step

    def _check_disk_ops(self, step) -> None:
        """The worker's disk ops, in its order (a clear first): each save names a block that
        holds one request's whole block of computed positions, under the key of the tokens up
        to that block's end, with the key before it and its tokens; each load names a saved key
        and a block nobody else holds, which then holds what was saved; drops name saved
        keys."""
        core_keys = isinstance(step.save_keys, bytes)  # the reference's keys are token tuples

        def unpacked(keys) -> list:
            return list(array("Q", keys)) if core_keys else list(keys)

        keys, parents = unpacked(step.save_keys), unpacked(step.save_parents)
        blocks, tokens = _i32(step.save_blocks), _i32(step.save_tokens)
        if not len(keys) == len(blocks) == len(parents) or len(tokens) != len(blocks) * self.bs:
            self._fail(f"step {step.step_id}: save fields of different lengths")
        loads, load_keys = _i32(step.load_blocks), unpacked(step.load_keys)
        drops = unpacked(step.drop_keys)
        if len(loads) != len(load_keys):
            self._fail(f"step {step.step_id}: {len(loads)} load blocks, {len(load_keys)} keys")
        if (blocks or drops or loads or step.clear_disk) and not self.cfg.get("disk_budget_blocks"):
            self._fail(f"step {step.step_id}: disk ops without a disk tier")
        if step.clear_disk:  # first: the step's saves are of blocks evicted after the flush
            self.disk.clear()
            event("disk tier: cleared")
        for i, (b, key) in enumerate(zip(blocks, keys, strict=True)):
            slots = self.kv[b]
            if slots[0] is None:
                self._fail(f"step {step.step_id}: saves block {b}, which holds no K/V")
            rid, first = slots[0]
            if first % self.bs or slots != [(rid, first + i) for i in range(self.bs)]:
                self._fail(f"step {step.step_id}: saves block {b}, not one whole block: {slots}")
            known = self.requests[rid].known[: first + self.bs]
            if len(known) != first + self.bs:
                self._fail(f"step {step.step_id}: saves block {b} past rid {rid}'s tokens")
            if core_keys:
                chain = self.planner.cache.block_keys(known)
                want, parent = chain[-1], chain[-2] if len(chain) > 1 else None
            else:
                want, parent = tuple(known), tuple(known[:first])
            if key != want:
                self._fail(f"step {step.step_id}: block {b} saved as {key}, expected {want}")
            if parent is not None and parents[i] != parent:
                self._fail(f"step {step.step_id}: block {b}'s parent key is {parents[i]}")
            if tokens[i * self.bs : (i + 1) * self.bs] != known[first:]:
                self._fail(f"step {step.step_id}: block {b} saved with other tokens")
            self.disk[key] = list(slots)
            event("disk tier: block saved")
        retracted = set(_i64(step.retracted))  # their blocks went back while planning
        held = {
            b
            for r in self.requests.values()
            if r.state == "running" and r.rid not in retracted
            for b in r.table
        }
        states = bytes(self.planner.block_states())
        for b, key in zip(loads, load_keys, strict=True):
            if key not in self.disk:
                self._fail(f"step {step.step_id}: loads key {key}, which was never saved")
            if b in held or states[b] != OWNED or loads.count(b) > 1:
                self._fail(f"step {step.step_id}: loads into block {b}, which is not free to")
            self._slot(b, 0)[:] = self.disk[key]
            event("disk tier: block loaded")
        if loads:
            self.step_loads[step.step_id] = loads
        for key in drops:
            if self.disk.pop(key, None) is None:
                self._fail(f"step {step.step_id}: drops key {key}, which is not on disk")
            event("disk tier: file dropped")

    def _samples(self, step_id: int, rids: list[int], accepted, token) -> tuple[list, list]:
        """The report of a step's sampling rids: a verify entry of k drafts names its rid
        a + 1 times, with its first a drafts (accepted) and one more token."""
        verify = self.step_verify[step_id]
        out_rids, tokens = [], []
        for rid in rids:
            req = self.requests[rid]
            if rid in verify and req.state != "done":
                a = accepted(verify[rid][1])
                out_rids += [rid] * (a + 1)
                drafts = req.verifying[:a] if req.verifying[0] is not None else None
                tokens += [*(drafts or [token() for _ in range(a)]), token()]
            else:
                out_rids.append(rid)
                tokens.append(token())
        return out_rids, tokens

    def _draft_some(self) -> None:
        """Like an engine that drafts by n-gram lookup: drafts for some decoding requests."""
        for req in self.requests.values():
            k_max = min(self.cfg["max_draft_tokens"], req.max_new - req.samples - 1)
            if req.state != "running" or not req.prefill_done or req.verifying or k_max < 1:
                continue
            if self.rng.random() < 0.5:
                tokens = [self.rng.randrange(8) for _ in range(self.rng.randint(1, k_max))]
                self._begin(f"advance: set_draft({req.rid}, {tokens})")
                self.planner.set_draft(req.rid, tokens)
                req.draft = tokens
                self._end()

    def _random_samples(self, step_id: int, rids: list[int]) -> tuple[list, list]:
        return self._samples(
            step_id, rids, lambda k: self.rng.randint(0, k), lambda: self.rng.randrange(8)
        )

    def _report(self, step_id: int, rids: list[int], tokens: list[int], as_bytes=False) -> None:
        loads = self.step_loads.pop(step_id, [])
        if loads and self.rng.random() < 0.3:  # a damaged file: that block is never used
            failed = self.rng.sample(loads, self.rng.randint(1, len(loads)))
            self.planner.fail_loads(step_id, failed)
            for b in failed:
                self.kv[b] = [None] * self.bs
            event("disk tier: load failed")
        verify = self.step_verify.pop(step_id)
        for rid in verify:  # a wrong draft among the accepted tokens is refused
            named = rids.count(rid)
            worker = self.requests[rid].verifying[:1] == [None]  # the core cannot check those
            if named > 1 and self.requests[rid].state != "done" and not worker:
                wrong = list(tokens)
                i = rids.index(rid)
                wrong[i] = (wrong[i] + 1) % 8
                with pytest.raises(RuntimeError):
                    self.planner.report(step_id, rids, wrong)
        if as_bytes:
            self.planner.report(step_id, array("q", rids).tobytes(), array("i", tokens).tobytes())
        else:
            self.planner.report(step_id, rids, tokens)
        self.inflight.pop(0)
        for rid, token in zip(rids, tokens, strict=True):
            req = self.requests[rid]
            if req.state != "done":  # the core ignores tokens of finished requests
                req.append(token)
        members = self.step_members.pop(step_id)
        for rid, (start, k) in verify.items():
            req = self.requests[rid]
            req.verifying = []
            named = rids.count(rid)
            new_end = start + named
            if named:
                event(f"verify accepted {'none' if named == 1 else 'all' if named > k else 'some'}")
            # The K/V past the accepted tokens is of rejected drafts: nobody may read it. Slots
            # another request rewrote since (its blocks went back at an abort or a retraction)
            # hold that request's K/V.
            for pos in range(new_end, start + 1 + k):
                b = req.table[pos // self.bs] if req.state == "running" else None
                for block in [b] if b is not None else range(len(self.kv)):
                    if self.kv[block][pos % self.bs] == (rid, pos):
                        self.kv[block][pos % self.bs] = None
            chained, req.chained = req.chained, None
            if chained is not None:
                self._resolve_chain(req, chained, new_end, accepted_all=named == k + 1)
            if req.state == "done":
                continue
            req.samples -= k + 1 - named
            if req.state == "running" and chained is None:
                members[rid] = new_end
                req.kv_len = new_end
                req.table = req.table[: -(-new_end // self.bs)]
            elif req.state == "running":
                members[rid] = new_end  # its computed positions; the chained entry's are later
        for rid, end in members.items():
            req = self.requests[rid]
            req.inflight -= 1
            if req.state == "running":
                req.computed = max(req.computed, end)
        self._resolve_reads()

    def _resolve_chain(
        self, req: Tracked, chained: tuple[int, int, list[int]], new_end: int, accepted_all: bool
    ) -> None:
        """The worker ran the entry chained behind a verify entry as planned when the verify
        accepted every draft; else as a plain decode at ``new_end`` (the position of the token
        sampled after the accepted drafts), and the core drops the positions past it."""
        sid, start, drafts = chained
        if accepted_all:
            req.verifying = list(drafts)
            event("chained entry stands")
            return
        event("chained entry degraded to a plain decode")
        self.step_verify[sid].pop(req.rid, None)
        if req.state == "done":
            return
        end = start + 1 + len(drafts)
        for pos in range(new_end, end):  # neither rejected drafts' nor planned chained K/V
            slots = self._slot(req.table[pos // self.bs], pos)
            if slots[pos % self.bs] == (req.rid, pos):
                slots[pos % self.bs] = None
        self._slot(req.table[new_end // self.bs], new_end)[new_end % self.bs] = (req.rid, new_end)
        req.samples -= len(drafts)
        self.step_members[sid][req.rid] = new_end + 1
        req.kv_len = new_end + 1
        req.table = req.table[: -(-(new_end + 1) // self.bs)]

    def _close(self, req: Tracked) -> None:
        req.state = "done"
        req.table, req.prefix_blocks, req.draft = [], [], []
        self.to_drop.add(req.rid)

    # -- what a Step must satisfy -------------------------------------------------------------

    def _on_step(self, step) -> None:
        sid = step.step_id
        if sid != self.next_step_id:
            self._fail(f"step id {sid}, expected {self.next_step_id}")
        self.next_step_id += 1
        self._check_disk_ops(step)  # before the step's writes: saves copy the old contents
        entries = _entries(step)
        self.auto_drafts = 0  # the planner's own drafts in this step (_check_entry)
        dropped, retracted = _i64(step.dropped), _i64(step.retracted)
        states = bytes(self.planner.block_states())
        cfg = self.cfg

        if sorted(dropped) != sorted(self.to_drop):
            self._fail(f"step {sid} dropped {sorted(dropped)}, expected {sorted(self.to_drop)}")
        self.to_drop.clear()

        # Budgets. A chunk that starts inside a whole span (or at its start) runs to the span's
        # end even past them; then it is the step's last prefill entry when the step's total
        # passes max_prefill_tokens (the budget left before it was positive).
        prefill = [e for e in entries if not e.decode]
        if len(entries) > cfg["max_running_requests"]:
            self._fail(f"step {sid}: {len(entries)} entries > max_running_requests")
        total = sum(e.n for e in prefill)
        if total > cfg["max_prefill_tokens"]:
            if (
                not self._span_completing(prefill[-1])
                or total - prefill[-1].n >= cfg["max_prefill_tokens"]
            ):
                self._fail(f"step {sid}: {total} prefill tokens > budget")
            event("whole span past the prefill budget")
        for e in prefill:
            if e.n > cfg["chunked_prefill_size"]:
                if not self._span_completing(e):
                    self._fail(f"step {sid}: rid {e.rid} chunk of {e.n} > chunked_prefill_size")
                event("whole span past chunked_prefill_size")
            # No chunk ends strictly inside a whole span of its request.
            end = e.start + e.n
            for start, stop in self.requests[e.rid].spans if e.rid in self.requests else []:
                if start < end < stop:
                    self._fail(
                        f"step {sid}: rid {e.rid}'s chunk [{e.start}, {end}) ends inside its "
                        f"whole span [{start}, {stop})"
                    )
                if start < e.start < stop:
                    event("prefix hit ends inside a whole span")
        if step.num_prefill_tokens != sum(e.n for e in prefill):
            self._fail(f"step {sid}: num_prefill_tokens {step.num_prefill_tokens} is wrong")
        if step.num_decode_tokens != sum(e.n for e in entries if e.decode):
            self._fail(f"step {sid}: num_decode_tokens {step.num_decode_tokens} is wrong")
        if len({e.rid for e in entries}) != len(entries):
            self._fail(f"step {sid}: a request appears twice")

        if cfg.get("tenant_fairness"):
            self._check_fair_retractions(sid, retracted, entries, bool(_i32(step.load_blocks)))
        # A request retracted in this plan may be re-admitted by it (then its entry is a new
        # admission, checked as such below), never continued.
        for rid in retracted:
            req = self.requests.get(rid)
            if req is None or req.state != "running":
                self._fail(f"step {sid}: retracted rid {rid} was not running")
            req.state, req.table, req.kv_len, req.prefix_blocks = "retracted", [], 0, []
            req.draft = []

        self._check_order(sid, entries, set(retracted))
        first_admissions = []
        admitted: list[tuple[Tracked, str]] = []  # (request, its state before) admitted now
        running_before = [r for r in self.requests.values() if r.state == "running"]
        written: dict[int, int] = {}  # block -> rid writing it in this step
        read: dict[int, int] = {}  # block -> rid reading it
        for e in entries:
            req = self.requests.get(e.rid)
            if req is None or req.state == "done":
                self._fail(f"step {sid}: entry for finished or unknown rid {e.rid}")
            if e.n < 1:
                self._fail(f"step {sid}: rid {e.rid} computes {e.n} tokens")
            if not req.admitted:
                first_admissions.append(req)
            prior = req.state
            fresh = self._check_entry(sid, req, e, states)
            if fresh:
                admitted.append((req, prior))
            self._collect_blocks(sid, req, e, written, read)
            if fresh:
                req.prefix_blocks = req.table[: e.start // self.bs]
                req.admit_seq, self.admissions = self.admissions, self.admissions + 1
                req.computed, req.prefill_done = e.start, False
                if req.cached_tokens < 0:
                    req.cached_tokens = e.start
            if e.sample:
                req.prefill_done = True
        for block, rid in read.items():
            if written.get(block, rid) != rid:
                self._fail(f"step {sid}: block {block} read by {rid}, written by {written[block]}")
        for e in entries:  # the worker writes the new K/V after all the reads of the step
            req = self.requests[e.rid]
            for pos in range(e.start, e.start + e.n):
                self._slot(req.table[pos // self.bs], pos)[pos % self.bs] = (e.rid, pos)
            req.kv_len = e.start + e.n
            req.inflight += 1
        if self.cfg.get("tenant_fairness"):
            self._check_fairness(sid, entries, {r.rid for r, _ in admitted})
        elif self.cfg["policy"] == "fcfs":
            self._check_fcfs(sid, first_admissions, {e.rid for e in entries})
        if self._by_priority:
            self._check_priority(sid, admitted, {e.rid for e in entries}, retracted, running_before)
        sampling = [e.rid for e in entries if e.sample]
        for what, seen in (
            ("retraction", retracted),
            ("drop", dropped),
            ("prefix hit", [e for e in entries if not e.decode and e.start and e.offset == 0]),
            ("chunk", [e for e in entries if not e.decode and not e.sample]),
            ("two in flight", len(self.inflight) == 1),
            ("decode new block", [e for e in entries if e.decode and e.blocks]),
        ):
            if seen:
                event(what)  # shown by --hypothesis-show-statistics: what the runs covered
        verify = {e.rid: (e.start, e.n - 1) for e in entries if e.decode and e.n > 1}
        if any(e.chained for e in entries):
            event("chained entry in a step")
        if cfg.get("speculative_ngram"):
            decodes = sum(e.decode for e in entries)
            budget = cfg["speculative_token_budget"]
            if self.auto_drafts > max(0, budget - decodes):
                self._fail(f"step {sid}: {decodes} decodes and {self.auto_drafts} n-gram drafts")
        if verify and retracted:
            self._fail(f"step {sid}: drafts were planned in a step that retracted {retracted}")
        if verify:
            event("verify entry")
        self.inflight.append((sid, sampling))
        self.step_members[sid] = {e.rid: e.start + e.n for e in entries}
        self.step_verify[sid] = verify

    def _span_completing(self, e: PlannedEntry) -> bool:
        """The entry starts inside a whole span of its request (or at its start) and ends at
        the span's end."""
        req = self.requests.get(e.rid)
        return req is not None and any(
            start <= e.start < stop == e.start + e.n for start, stop in req.spans
        )

    def _slot(self, block: int, pos: int) -> list:
        while block >= len(self.kv):
            self.kv.append([None] * self.bs)
        return self.kv[block]

    def _check_order(self, sid: int, entries: list[PlannedEntry], retracted: set[int]) -> None:
        """Decodes (oldest admission first), then continued chunks, then new admissions; and
        every running request with samples left gets its decode."""
        kinds, seqs = [], []
        for e in entries:
            req = self.requests.get(e.rid)
            fresh = req is None or req.state in ("waiting", "retracted")
            kinds.append(0 if e.decode else 2 if fresh else 1)
            # the running order: by priority (0 but under the priority policy), then admission
            seqs.append(
                (kinds[-1], req.priority if req else 0, req.admit_seq if req and not fresh else 0)
            )
        if kinds != sorted(kinds):
            self._fail(f"step {sid}: entries not in the order decodes, chunks, admissions")
        if [q for q in seqs if q[0] < 2] != sorted(q for q in seqs if q[0] < 2):
            self._fail(f"step {sid}: decodes or chunks not in admission order")
        decoded = {e.rid for e in entries if e.decode}
        for req in self.requests.values():
            if req.state != "running" or not req.prefill_done or req.samples >= req.max_new:
                continue
            if req.verifying:  # waits for the report of its verify entry
                continue
            if req.rid not in decoded and req.rid not in retracted:
                self._fail(f"step {sid}: running rid {req.rid} got no decode entry")

    def _check_entry(self, sid: int, req: Tracked, e: PlannedEntry, states: bytes) -> bool:
        """Checks one entry against the request's known tokens; updates the worker's table.

        Returns whether it starts a new admission (a table of its own replaced wholesale).
        """
        bs, where = self.bs, f"step {sid} rid {e.rid}"
        fresh = req.state in ("waiting", "retracted")
        if fresh and (e.decode or e.offset != 0):
            self._fail(f"{where}: a new admission must be a prefill with block_offset 0")
        if e.offset > len(req.table):
            self._fail(f"{where}: block_offset {e.offset} beyond a table of {len(req.table)}")
        table = req.table[: e.offset] + e.blocks
        if len(table) != math.ceil((e.start + e.n) / bs):
            self._fail(
                f"{where}: table of {len(table)} blocks for positions [0, {e.start + e.n}) "
                f"with block_size {bs}"
            )
        if fresh:
            if e.start % bs or e.start >= len(req.known):
                self._fail(f"{where}: admission starts at {e.start} of {len(req.known)} tokens")
            if req.inflight:
                self._fail(f"{where}: re-admitted while {req.inflight} steps with it are in flight")
            if not self.cfg["enable_radix_cache"] and e.start != 0:
                self._fail(f"{where}: prefix hit with the radix cache disabled")
            if not req.match_prefix and e.start != 0:
                self._fail(f"{where}: prefix hit for a request that matches none")
            for b in table[: e.start // bs]:
                if states[b] != CACHED:
                    self._fail(f"{where}: prefix block {b} is not in the cache")
            req.state, req.admitted = "running", True
        elif e.start != req.kv_len:
            self._fail(f"{where}: starts at {e.start}, but its KV holds {req.kv_len} positions")
        if e.decode:
            if e.chained:  # behind its unreported verify entry, as if that accepts every draft
                if not self.cfg.get("speculative_chain") or not req.verifying or req.chained:
                    self._fail(f"{where}: chained, but not behind one unreported verify entry")
                if req.inflight != 1 or req.draft:
                    self._fail(f"{where}: chained with {req.inflight} steps in flight")
                event("chained entry" + (" with drafts" if e.n > 1 else ""))
            elif req.verifying:
                self._fail(f"{where}: planned before the report verifying its drafts")
            draft, req.draft = req.draft, []  # one plan consumes them, verified or not
            if e.worker_drafts:  # any tokens: the draft model's, which the core never sees
                if not self.cfg.get("speculative_draft_model") or draft or e.input_ids:
                    self._fail(f"{where}: drafts for a worker draft model it does not run")
                draft = [None] * (e.n - 1)
                event("draft-model verify entry")
                self.auto_drafts += len(draft)
            elif not draft and e.n > 1 and (e.chained or self.cfg.get("speculative_ngram")):
                draft = e.input_ids  # the planner's own n-gram drafts
                if len(draft) > self.cfg["max_draft_tokens"]:
                    self._fail(f"{where}: {len(draft)} drafts > max_draft_tokens")
                event("n-gram drafts")
                self.auto_drafts += len(draft)
            inputs = [] if e.worker_drafts else draft
            if not e.sample or (e.n, e.input_ids) not in ((1, []), (1 + len(draft), inputs)):
                self._fail(
                    f"{where}: a decode computes its last token ({e.n} positions, inputs "
                    f"{e.input_ids}) and samples; drafts {draft}"
                )
            if draft and e.n == 1:
                event("drafts fell back to a plain decode")
            if e.start != len(req.prompt) + req.samples - 1:
                self._fail(
                    f"{where}: decode at {e.start}, but its last sampled token sits at "
                    f"{len(req.prompt) + req.samples - 1}"
                )
        else:
            if e.input_ids != req.known[e.start : e.start + e.n]:
                self._fail(f"{where}: input_ids {e.input_ids} are not its tokens at {e.start}")
            ends = e.start + e.n == len(req.known)
            if e.sample != ends:
                self._fail(f"{where}: sample={e.sample} but the prefill ends={ends}")
            if e.sample and req.samples != req.output_len:
                self._fail(f"{where}: recompute samples before all its outputs are known")
        if e.chained:
            req.chained = (sid, e.start, e.input_ids)
        elif e.decode and e.n > 1:
            req.verifying = [None] * (e.n - 1) if e.worker_drafts else e.input_ids
        if e.sample:
            req.samples += e.n if e.decode else 1  # a verify entry: up to 1 + k tokens
            if req.samples > req.max_new:
                self._fail(f"{where}: sample {req.samples} beyond max_new_tokens {req.max_new}")
        for pos in range(e.start, e.start + e.n):
            b = table[pos // bs]
            if states[b] != OWNED:
                self._fail(f"{where}: writes block {b} whose state is {states[b]}, not owned")
        req.table = table
        return fresh

    def _collect_blocks(self, sid: int, req: Tracked, e: PlannedEntry, written, read) -> None:
        """Records the blocks this entry reads and writes, and queues content checks."""
        bs = self.bs
        for pos in range(e.start, e.start + e.n):
            b = req.table[pos // bs]
            if written.setdefault(b, e.rid) != e.rid:
                self._fail(f"step {sid}: block {b} written by {written[b]} and {e.rid}")
        # a chained entry reads the drafts of the verify entry before it only when that accepts
        # them all (else the worker runs it below them); their tokens are known then
        assumed = e.start - len(req.verifying) if e.chained else e.start
        for pos in range(e.start):
            b = req.table[pos // bs]
            read.setdefault(b, e.rid)
            slot = self._slot(b, pos)[pos % bs]
            if slot is None or slot[1] != pos:
                self._fail(
                    f"step {sid} rid {e.rid}: reads position {pos} from block {b}, "
                    f"which holds {slot} (rid, position)"
                )
            if pos < assumed:
                self.pending_reads.append((e.rid, slot[0], pos, sid))
        self._resolve_reads()

    def _resolve_reads(self, final: bool = False) -> None:
        """A read is right when the writer's tokens up to that position equal the reader's."""
        pending = []
        for reader, writer, pos, sid in self.pending_reads:
            r, w = self.requests[reader], self.requests[writer]
            if len(r.known) <= pos or len(w.known) <= pos:
                if final:
                    self._fail(
                        f"step {sid}: rid {reader} read position {pos} of rid {writer}, "
                        f"whose token there never became known"
                    )
                pending.append((reader, writer, pos, sid))
            elif r.hashes[pos + 1] != w.hashes[pos + 1]:
                self._fail(
                    f"step {sid}: rid {reader} reads the K/V of position {pos} written by rid "
                    f"{writer} for different tokens: {r.known[: pos + 1]} vs {w.known[: pos + 1]}"
                )
        self.pending_reads = pending

    def _loading(self, req: Tracked) -> bool:
        """Whether a waiting request loads its prefix from disk in a step in flight (admission
        passes over it until that step's report)."""
        if req.state not in ("waiting", "retracted") or not self.cfg.get("disk_budget_blocks"):
            return False
        return self.planner.request(req.rid)["inflight_steps"] > req.inflight

    def _check_fcfs(self, sid: int, first: list[Tracked], planned: set[int]) -> None:
        """fcfs: nobody is admitted for the first time ahead of an earlier or retracted one."""
        if not first:
            return
        newest = max(r.arrival for r in first)
        for req in self.requests.values():
            if req.rid in planned or req.state == "done" or self._loading(req):
                continue
            if req.state == "waiting" and req.arrival < newest:
                self._fail(f"step {sid}: fcfs admitted a later request before rid {req.rid}")
            if req.state == "retracted" and req.inflight == 0 and req.output_len < req.max_new:
                self._fail(f"step {sid}: fcfs admitted a new request before retracted {req.rid}")

    def _check_fairness(self, sid: int, entries: list[PlannedEntry], admitted: set[int]) -> None:
        """Tenant fairness: each admission is of a tenant with no more tokens served (counting
        this step's entries before it) than any tenant with an admissible request waiting. After
        a fairness retraction, the first admission counts as at the plan's start: the room went
        to the request it was made for."""
        served = dict(self.served_before)
        planned = {e.rid for e in entries}
        made_room = self.planner.stats()["fairness_retractions"] > self.fair_retractions_before
        for e in entries:
            req = self.requests[e.rid]
            if e.rid in admitted:
                counts = self.served_before if made_room else served
                made_room = False
                for other in self.requests.values():
                    if other.rid in planned or other.state not in ("waiting", "retracted"):
                        continue
                    if other.inflight or other.output_len >= other.max_new or self._loading(other):
                        continue
                    if counts[other.tenant] < counts[req.tenant]:
                        self._fail(
                            f"step {sid}: admitted rid {e.rid} of tenant {req.tenant} "
                            f"({counts[req.tenant]} tokens served) ahead of rid {other.rid} of "
                            f"tenant {other.tenant} ({counts[other.tenant]})"
                        )
                if len({r.tenant for r in self.requests.values() if r.state != "done"}) > 1:
                    event("fairness: admission among tenants")
            end = e.start + e.n
            if end > req.served_to:  # a recompute below its furthest position is not served
                served[req.tenant] = served.get(req.tenant, 0) + end - max(e.start, req.served_to)
                req.served_to = end
        if served != dict(self.planner.stats()["tenant_tokens"]):
            self._fail(
                f"step {sid}: tenant_tokens {self.planner.stats()['tenant_tokens']}, expected "
                f"{served} (each request's positions past its furthest planned before)"
            )

    def _check_fair_retractions(
        self, sid: int, retracted: list[int], entries: list[PlannedEntry], loads: bool
    ) -> None:
        """Tenant fairness: the step's first retractions (as many as fairness_retractions grew)
        are of running requests with samples left whose tenants were served more than the
        least-served tenant with an admissible request waiting, by more than the quantum; every
        such request that keeps running is of a tenant served less, or equally and admitted
        earlier, than each of them (the most served go first, the latest admitted among equals).
        Counts are those at the start of the plan. And the room made goes to the least-served
        tenant in the same step (below: when nothing else in the step takes it, without the
        radix cache)."""
        n = self.planner.stats()["fairness_retractions"] - self.fair_retractions_before
        if not n:
            return
        event("fairness: retraction")
        served, quantum = self.served_before, self.cfg["fairness_quantum"]
        waiting = [
            r.tenant
            for r in self.requests.values()
            if r.state in ("waiting", "retracted")
            and not r.inflight
            and r.output_len < r.max_new
            and r.rid not in self.loading_before
        ]
        if not waiting or n > len(retracted):
            self._fail(f"step {sid}: {n} fairness retractions of {retracted}, {waiting} waiting")
        least = min(served[t] for t in waiting)

        def eligible(r: Tracked) -> bool:
            return r.samples < r.max_new and served[r.tenant] - least > quantum

        victims = [self.requests[rid] for rid in retracted[:n]]
        for v in victims:
            if v.state != "running" or not eligible(v):
                self._fail(
                    f"step {sid}: retracted rid {v.rid} ({v.state}, tenant {v.tenant} served "
                    f"{served[v.tenant]}) for fairness, the least served waiting at {least}"
                )
        last = min((served[v.tenant], v.admit_seq) for v in victims)
        for r in self.requests.values():
            kept = r.state == "running" and r.rid not in retracted and eligible(r)
            if kept:
                event("fairness: retraction keeps a retractable request running")
            if kept and (served[r.tenant], r.admit_seq) > last:
                self._fail(
                    f"step {sid}: rid {r.rid} (tenant {r.tenant}, served "
                    f"{served[r.tenant]}) keeps running while rid {victims[-1].rid} was "
                    f"retracted for fairness"
                )
        # No starvation: the room goes to the least-served tenant (at the plan's start) in the
        # same step, even when the step's decodes leave another tenant the least served by the
        # admissions, unless something else in it takes blocks or budget first (a memory
        # retraction, a prefill chunk of an earlier admission, a decode's new block, a disk
        # load). Without the radix cache: with it, the blocks a victim gives back are an estimate
        # (shared and locked prefixes).
        others = (
            self.cfg["enable_radix_cache"]
            or len(retracted) > n
            or loads
            or any(e.decode and e.blocks for e in entries)
            or any(not e.decode and self.requests[e.rid].state == "running" for e in entries)
        )
        if others:
            return
        first = {t for t in waiting if served[t] == least}
        fresh = {self.requests[e.rid].tenant for e in entries if not e.decode}
        if len(first) == 1 and not first & fresh:
            self._fail(
                f"step {sid}: retracted {retracted[:n]} for fairness, then admitted no request "
                f"of tenant {first.pop()} (served {least}, the least)"
            )
        event("fairness: retraction makes room in the step")

    def _check_priority(
        self,
        sid: int,
        admitted: list[tuple[Tracked, str]],
        planned: set[int],
        retracted: list[int],
        running_before: list[Tracked],
    ) -> None:
        """priority: nobody is admitted ahead of an admissible request with a smaller priority
        value, of an earlier one of its value, or of a retracted one of its value (retracted
        requests go first in their class); and a retraction takes running requests whose
        priority values are at least those of every retractable request that keeps running."""
        for f, prior in admitted:
            for req in self.requests.values():
                if req.rid in planned or req.state not in ("waiting", "retracted"):
                    continue
                if req.inflight or req.output_len >= req.max_new or self._loading(req):
                    continue  # not admissible now: admission passes over it
                ahead = req.priority < f.priority or (
                    req.priority == f.priority
                    and (
                        (req.state == "retracted" and prior == "waiting")
                        or (req.state == prior == "waiting" and req.arrival < f.arrival)
                    )
                )
                if ahead:
                    self._fail(
                        f"step {sid}: admitted rid {f.rid} (priority {f.priority}, {prior}) "
                        f"ahead of rid {req.rid} (priority {req.priority}, {req.state})"
                    )
        if not retracted:
            return
        event("priority: retraction")
        lowest = min(self.requests[rid].priority for rid in retracted)
        for req in running_before:
            if req.state == "running" and req.samples < req.max_new and req.priority > lowest:
                self._fail(
                    f"step {sid}: retracted priority {lowest} while rid {req.rid} of priority "
                    f"{req.priority} keeps running"
                )
        if any(prior == "waiting" for _, prior in admitted):
            event("priority: retraction and admission in one step")

    # -- invariants after every operation -----------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        if self.ready and not self.busy:
            self._check_all()

    def _check_all(self) -> None:
        p = self.planner
        try:
            p.check_invariants()
        except RuntimeError as exc:
            self._fail(f"check_invariants(): {exc}")
        states, refs = bytes(p.block_states()), _i32(p.refcounts())
        if len(states) != self.num_blocks or len(refs) != self.num_blocks:
            self._fail("block_states()/refcounts() do not cover the pool")
        running = [r for r in self.requests.values() if r.state == "running"]
        holders = [0] * self.num_blocks
        for req in running:
            for b in req.table:
                holders[b] += 1
        for b in range(self.num_blocks):
            s, rc = states[b], refs[b]
            if s not in (FREE, OWNED, CACHED) or rc < 0:
                self._fail(f"block {b}: state {s}, refcount {rc}")
            if (s == FREE) != (rc == 0):
                self._fail(f"block {b}: state {s} with refcount {rc}")
            # a load's block is held by its waiting request until the report, or until that
            # request ends (which the machine cannot tell from the step): check_invariants
            # counts those exactly
            loading = any(b in blocks for blocks in self.step_loads.values())
            if rc != holders[b] + (s == CACHED) and not (
                loading and rc == holders[b] + (s == CACHED) + 1
            ):
                self._fail(
                    f"block {b}: refcount {rc}, but {holders[b]} running tables hold it "
                    f"and cached={s == CACHED}"
                )
        if p.num_free_blocks != states.count(FREE):
            self._fail(f"num_free_blocks {p.num_free_blocks}, {states.count(FREE)} free")
        if p.num_running != len(running):
            self._fail(f"num_running {p.num_running}, expected {len(running)}")
        live = [r for r in self.requests.values() if r.state != "done"]
        if p.num_waiting != len(live) - len(running):
            self._fail(f"num_waiting {p.num_waiting}, expected {len(live) - len(running)}")
        if p.num_inflight_steps != len(self.inflight):
            self._fail(f"num_inflight_steps {p.num_inflight_steps}, expected {len(self.inflight)}")
        for req in running:  # locked prefixes are never evicted
            for b in req.prefix_blocks:
                if states[b] != CACHED:
                    self._fail(f"rid {req.rid}: its locked prefix block {b} left the cache")
        for req in live:
            info = p.request(req.rid)
            if info["state"] != req.state or info["output_len"] != req.output_len:
                self._fail(f"request({req.rid}) = {info}, expected {req.state}/{req.output_len}")
            if info["prompt_len"] != len(req.prompt) or info["max_new_tokens"] != req.max_new:
                self._fail(f"request({req.rid}) = {info}: wrong prompt_len or max_new_tokens")
            if info["tenant"] != req.tenant:
                self._fail(f"request({req.rid}) = {info}: tenant should be {req.tenant}")
            if info["priority"] != req.priority:
                self._fail(f"request({req.rid}) = {info}: priority should be {req.priority}")
            if list(info["output"]) != req.known[len(req.prompt) :]:
                self._fail(f"request({req.rid}) output {info['output']} is not what was reported")
            if (info["draft_len"], info["verifying"]) != (len(req.draft), len(req.verifying)):
                self._fail(f"request({req.rid}) = {info}: drafts {req.draft}, {req.verifying}")
            # a waiting request may be loading its prefix in one step (not an entry of it)
            loads = req.state in ("waiting", "retracted") and bool(self.step_loads)
            if info["inflight_steps"] != req.inflight and not (
                loads and info["inflight_steps"] == req.inflight + 1
            ):
                self._fail(f"request({req.rid}) = {info}: {req.inflight} steps in flight")
            if req.admitted and info["cached_tokens"] != req.cached_tokens:
                self._fail(f"request({req.rid}) = {info}: cached_tokens {req.cached_tokens}")
            running = req.state == "running"
            expected = dict(
                num_scheduled=req.kv_len if running else 0,
                num_computed=req.computed if running else 0,
                num_blocks=len(req.table),
            )
            if running:
                expected["planned_samples"] = req.samples
            for key, value in expected.items():
                if info[key] != value:
                    self._fail(f"request({req.rid}) = {info}: {key} should be {value}")
        self._check_cache_contents(states)

    def _check_cache_contents(self, states: bytes) -> None:
        """Every cached block holds the K/V of one token prefix; match_prefix finds them all."""
        bs = self.bs
        by_key: dict[tuple[int, int], int] = {}
        parents: list[tuple[int, tuple[int, int]]] = []
        for b in range(self.num_blocks):
            if states[b] != CACHED:
                continue
            slots = self._slot(b, 0)
            if any(s is None for s in slots) or slots[0][1] % bs:
                self._fail(f"cached block {b} holds {slots}: not one whole written block")
            base = slots[0][1]
            last = self.requests[slots[-1][0]]
            for j, (writer, pos) in enumerate(slots):
                w = self.requests[writer]
                if pos != base + j or len(w.known) <= pos or len(last.known) <= pos:
                    self._fail(f"cached block {b} holds {slots}: a position is unknown")
                if w.hashes[pos + 1] != last.hashes[pos + 1]:
                    self._fail(f"cached block {b}: its slots were written for different prefixes")
            key = last.hashes[base + bs]
            if key in by_key:
                self._fail(f"blocks {by_key[key]} and {b} are cached for the same prefix")
            by_key[key] = b
            if base:
                parents.append((b, last.hashes[base]))
        for b, parent in parents:
            if parent not in by_key:
                self._fail(f"cached block {b} has no cached parent block")
        queries = [r.known for r in self.requests.values()] + self.prefixes
        for tokens in queries:
            expected: list[int] = []
            hashes = _prefix_hashes(tokens)
            while (len(expected) + 1) * bs <= len(tokens):
                block = by_key.get(hashes[(len(expected) + 1) * bs])
                if block is None:
                    break
                expected.append(block)
            n, blocks, _ = self.planner.cache.match_prefix(tokens)
            blocks = _block_ids(blocks)
            if n != len(expected) * bs or blocks != expected:
                self._fail(
                    f"match_prefix({tokens}) = {n}, {blocks}; "
                    f"the cached blocks' contents give {len(expected) * bs}, {expected}"
                )

    # -- the end of every run: drain, flush, everything free ----------------------------------

    def teardown(self) -> None:
        if not self.ready or self.busy:
            return  # an operation failed; its error is the one to report
        self._begin("draining the planner to completion")
        budget = 60 + 12 * sum(len(r.prompt) + r.max_new for r in self.requests.values())
        for _ in range(budget):
            for req in self.requests.values():
                if req.state != "done" and req.output_len >= req.max_new:
                    self.op = f"drain: finish({req.rid}) at max_new_tokens"
                    self.planner.finish(req.rid)
                    self._close(req)
            self._check_all()
            if len(self.inflight) < MAX_INFLIGHT:
                self.op = "drain: plan()"
                if self._plan_once() is not None:
                    self._check_all()
                    continue
            if not self.inflight:
                break
            step_id, rids = self.inflight[0]
            self.op = f"drain: report(step {step_id})"
            self._report(step_id, *self._random_samples(step_id, rids))
            self._check_all()
        self._resolve_reads(final=True)
        stuck = {r.rid: r.state for r in self.requests.values() if r.state != "done"}
        if stuck or self.inflight:
            self._fail(f"requests never finished (starvation or deadlock): {stuck}")
        if self.planner.plan() is not None:
            self._fail("plan() returned a Step with nothing left to do")
        self.op = "drain: flush_cache()"
        self.planner.flush_cache()
        states = bytes(self.planner.block_states())
        if states != bytes(self.num_blocks) or self.planner.num_free_blocks != self.num_blocks:
            self._fail(f"blocks not free after everything finished and a flush: {list(states)}")
        if self.planner.num_running or self.planner.num_waiting:
            self._fail("requests left in the planner after draining")
        self.busy = False


class LockstepMachine(RuleBasedStateMachine):
    """The core and the reference planner driven by the same calls, drafts and reports
    included: every Step (block ids too), every refusal, every request and the statistics must
    agree, and both must pass check_invariants after every rule. The radix cache is off: with
    it on, the two caches may lay out their nodes differently and evict in another order."""

    @initialize(config=planner_configs(), seed=st.integers(0, 2**16))
    def setup(self, config: dict, seed: int) -> None:
        self.cfg = dict(config, enable_radix_cache=False, disk_budget_blocks=0)
        self.planners = (core.Planner(**self.cfg), reference.Planner(**self.cfg))
        self.rng = random.Random(seed)
        self.inflight: list[tuple[int, list[dict]]] = []  # (step id, entries)
        self.next_rid = 0

    def _both(self, what: str, call) -> list:
        """call(planner) on both; they must return equal values or raise the same kind."""
        outcomes = []
        for p in self.planners:
            try:
                outcomes.append(("returned", call(p)))
            except (KeyError, ValueError, RuntimeError) as exc:
                kind = next(k for k in (KeyError, ValueError, RuntimeError) if isinstance(exc, k))
                outcomes.append(("raised", kind.__name__))
        if outcomes[0] != outcomes[1]:
            raise CoreViolation(f"{what}: core {outcomes[0]}, reference {outcomes[1]}")
        return outcomes[0]

    def _known(self, rid: int) -> dict | None:
        try:
            return self.planners[0].request(rid)
        except KeyError:
            return None

    @rule(
        max_new=st.integers(1, 10),
        prompt=st.lists(st.integers(0, 7), max_size=16),
        data=st.data(),
    )
    def add(self, max_new: int, prompt: list[int], data: st.DataObject) -> None:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        spans = _draw_spans(lambda s, label: data.draw(s, label=label), len(prompt))
        # a nonzero priority under another policy: refused by both
        prio = data.draw(st.integers(-1, 2), label="priority")
        if self.cfg["policy"] != "priority" and data.draw(st.integers(0, 5)):
            prio = 0
        tenant = data.draw(st.integers(-1, 2), label="tenant")
        if not self.cfg["tenant_fairness"] and data.draw(st.integers(0, 5)):
            tenant = 0  # else refused by both
        self._both(
            f"add_request({rid}, whole_spans={_span_pairs(spans)}, priority={prio}, "
            f"tenant={tenant})",
            lambda p: p.add_request(
                rid, prompt, max_new, whole_spans=spans, priority=prio, tenant=tenant
            ),
        )

    def _decoding(self) -> list[int]:
        """Requests that can take drafts (their prefill sampled, no verify in flight)."""
        out = []
        for rid in range(self.next_rid):
            info = self._known(rid)
            if info and info["state"] == "running" and info["output_len"] and not info["verifying"]:
                out.append(rid)
        return out

    @rule(data=st.data())
    def draft(self, data: st.DataObject) -> None:
        decoding = self._decoding()
        if decoding and data.draw(st.integers(0, 3), label="decoding rid") > 0:
            rid = data.draw(st.sampled_from(decoding), label="rid")
        else:
            rid = data.draw(st.integers(0, self.next_rid), label="rid")
        k = data.draw(st.integers(0, self.cfg["max_draft_tokens"] + 1), label="k")
        token = st.integers(0, 7) | st.just(VOCAB)  # now and then out of range
        tokens = data.draw(st.lists(token, min_size=k, max_size=k), label="draft")
        self._both(f"set_draft({rid}, {tokens})", lambda p: p.set_draft(rid, tokens))

    @rule(cycles=st.integers(1, 8))
    def advance(self, cycles: int) -> None:
        """An engine loop: drafts for decoding requests, two steps in flight, random accepts."""
        for _ in range(cycles):
            for rid in self._decoding():
                info = self.planners[0].request(rid)
                room = info["max_new_tokens"] - info["planned_samples"] - 1
                k = self.rng.randint(0, max(0, min(self.cfg["max_draft_tokens"], room)))
                tokens = [self.rng.randrange(8) for _ in range(k)]
                self._both(
                    f"set_draft({rid}, {tokens})",
                    lambda p, rid=rid, tokens=tokens: p.set_draft(rid, tokens),
                )
            if len(self.inflight) < MAX_INFLIGHT:
                self.plan()
            if self.inflight and (len(self.inflight) == MAX_INFLIGHT or self.rng.random() < 0.5):
                self._report_oldest(lambda n: self.rng.randint(0, n), corrupt=False)

    @precondition(lambda self: len(self.inflight) < MAX_INFLIGHT)
    @rule()
    def plan(self) -> None:
        _, step = self._both(
            "plan()",
            lambda p: (
                (s := p.plan()) and (s.step_id, s.entries(), bytes(s.dropped), bytes(s.retracted))
            ),
        )
        if step:
            self.inflight.append((step[0], step[1]))
            if any(e["is_decode"] and e["num_tokens"] > 1 for e in step[1]):
                event("lockstep: verify entry")
            if step[3] and self.planners[0].stats()["fairness_retractions"]:
                event("lockstep: fairness retraction")

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        self._report_oldest(lambda n: data.draw(st.integers(0, n), label="draw"), corrupt=True)

    def _report_oldest(self, draw, corrupt: bool) -> None:
        step_id, entries = self.inflight[0]
        rids, tokens = [], []
        for e in entries:
            info = self._known(e["rid"])
            if not e["sample"] or info is None or info["state"] == "done":
                continue
            drafts = e["input_ids"] if e["is_decode"] else []
            a = draw(len(drafts))  # accepted drafts
            rids += [e["rid"]] * (a + 1)
            tokens += [*drafts[:a], draw(7)]
        if rids and corrupt and draw(7) == 0:  # a refused report changes nothing
            i = draw(len(tokens) - 1)
            wrong = [*tokens[:i], (tokens[i] + 1) % 8, *tokens[i + 1 :]]
            self._both(
                f"report({step_id}, {rids}, {wrong})", lambda p: p.report(step_id, rids, wrong)
            )
        self._both(
            f"report({step_id}, {rids}, {tokens})", lambda p: p.report(step_id, rids, tokens)
        )
        self.inflight.pop(0)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.integers(0, self.next_rid), label="rid")
        self._both(f"abort({rid})", lambda p: p.abort(rid))

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.integers(0, self.next_rid), label="rid")
        self._both(f"finish({rid})", lambda p: p.finish(rid))

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "planners"):
            return
        for p in self.planners:
            p.check_invariants()
        self._both("stats()", lambda p: p.stats())
        self._both("refcounts()", lambda p: bytes(p.refcounts()))
        for rid in range(self.next_rid):
            self._both(f"request({rid})", lambda p, rid=rid: p.request(rid))


_PLANNER_SETTINGS = dict(
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestPlannerCore = PlannerMachine.TestCase
TestPlannerCore.settings = settings(max_examples=300, **_PLANNER_SETTINGS)


class ReferencePlannerMachine(PlannerMachine):
    impl = reference


TestPlannerReference = ReferencePlannerMachine.TestCase
TestPlannerReference.settings = settings(max_examples=40, **_PLANNER_SETTINGS)


@st.composite
def ngram_planner_configs(draw) -> dict:
    """Configurations whose planner drafts by itself from n-grams of a small vocabulary."""
    return dict(
        draw(planner_configs()),
        max_draft_tokens=draw(st.integers(1, 5)),
        speculative_ngram=True,
        ngram_min_match=draw(st.integers(1, 2)),
        ngram_max_match=draw(st.integers(2, 4)),
        ngram_corpus_tokens=draw(st.sampled_from([0, 0, 40, 400])),
        speculative_token_budget=draw(st.integers(1, 12)),
        speculative_chain=draw(st.booleans()),
    )


def _small_vocab_setup(configs: st.SearchStrategy) -> Callable:
    """PlannerMachine's set-up over ``configs``, with prefixes of tokens 0..7 (so that n-grams
    repeat and match often)."""

    @initialize(
        config=configs,
        prefixes=st.lists(
            st.lists(st.integers(0, 7), min_size=1, max_size=40), min_size=1, max_size=3
        ),
        seed=st.integers(0, 2**16),
        data=st.data(),
    )
    def setup(self, config: dict, prefixes: list[list[int]], seed: int, data) -> None:
        PlannerMachine.setup(self, config, prefixes, seed, data)

    return setup


class NgramDraftingPlannerMachine(PlannerMachine):
    """The core planner drafting by itself, with explicit drafts and every other rule still
    mixed in."""

    setup = _small_vocab_setup(ngram_planner_configs())


TestPlannerNgramDrafts = NgramDraftingPlannerMachine.TestCase


class DraftModelPlannerMachine(PlannerMachine):
    """The core planning verify entries whose drafts a worker's draft model writes."""

    setup = _small_vocab_setup(
        ngram_planner_configs().map(
            lambda c: {
                **c,
                "speculative_ngram": False,
                "speculative_draft_model": True,
                "speculative_chain": False,
            }
        )
    )


TestPlannerDraftModel = DraftModelPlannerMachine.TestCase
TestPlannerNgramDrafts.settings = settings(max_examples=150, **_PLANNER_SETTINGS)
TestPlannerDraftModel.settings = settings(max_examples=100, **_PLANNER_SETTINGS)

TestPlannerLockstep = LockstepMachine.TestCase
TestPlannerLockstep.settings = settings(max_examples=300, **_PLANNER_SETTINGS)


@st.composite
def fair_planner_configs(draw) -> dict:
    """Tenant fairness with few running slots and small quanta: preemption for fairness often."""
    return dict(
        draw(planner_configs()),
        policy="fcfs",
        tenant_fairness=True,
        max_running_requests=draw(st.integers(1, 3)),
        fairness_quantum=draw(st.sampled_from([0, 1, 4, 12])),
    )


class FairPlannerMachine(PlannerMachine):
    """The core planner under tenant fairness, three tenants contending for a few slots."""

    setup = _small_vocab_setup(fair_planner_configs())


class FairLockstepMachine(LockstepMachine):
    """The core and the reference in lockstep under tenant fairness."""

    @initialize(config=fair_planner_configs(), seed=st.integers(0, 2**16))
    def setup(self, config: dict, seed: int) -> None:
        LockstepMachine.setup(self, config, seed)


TestPlannerCoreFairness = FairPlannerMachine.TestCase
TestPlannerCoreFairness.settings = settings(max_examples=150, **_PLANNER_SETTINGS)
TestPlannerLockstepFairness = FairLockstepMachine.TestCase
TestPlannerLockstepFairness.settings = settings(max_examples=150, **_PLANNER_SETTINGS)
