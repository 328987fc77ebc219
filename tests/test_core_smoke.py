"""Smoke tests of the ``pyserve._core`` bindings: exception mapping, array formats, threads.

The behaviour of the core itself is specified by the C++ tests (cpp/tests) and checked against a
reference model by tests/test_core_properties.py; this file checks only the Python boundary.
"""

from __future__ import annotations

import re
import threading
from array import array

import numpy as np
import pytest

from pyserve import _core as core
from pyserve.engine.scheduler_loop import whole_spans
from pyserve.wire import main_to_worker


def _i32(data: bytes) -> list[int]:
    return array("i", data).tolist()


def _i64(data: bytes) -> list[int]:
    return array("q", data).tolist()


def _planner(**kwargs) -> core.Planner:
    return core.Planner(kwargs.pop("num_blocks", 32), kwargs.pop("block_size", 4), **kwargs)


def _report_all(planner: core.Planner, step, token: int = 1) -> None:
    rids = [e["rid"] for e in step.entries() if e["sample"]]
    planner.report(step.step_id, array("q", rids).tobytes(), array("i", [token] * len(rids)))


# -- exceptions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: core.BlockAllocator(0),
        lambda: core.RadixCache(0, core.BlockAllocator(4)),
        lambda: _planner(policy="random"),
        lambda: _planner(block_size=0),
        lambda: _planner(max_running_requests=0),
        lambda: _planner(init_reserve_ratio=0.05, min_reserve_ratio=0.1),
    ],
)
def test_bad_settings_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_allocator_errors_map_to_value_and_runtime_errors():
    alloc = core.BlockAllocator(2)
    packed = alloc.allocate(2)
    ids = _i32(packed)
    assert ids == [0, 1]  # a fresh pool hands out 0, 1, 2, ...
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        alloc.allocate(1)
    with pytest.raises(ValueError, match="negative"):
        alloc.allocate(-1)
    alloc.decref(packed)
    with pytest.raises(ValueError, match="refcount 0"):
        alloc.decref([ids[0]])
    with pytest.raises(ValueError, match="free"):
        alloc.incref([ids[0]])
    with pytest.raises(ValueError, match="out of range"):
        alloc.refcount(5)
    alloc.check_invariants()


def test_cache_errors_map_to_value_error():
    alloc = core.BlockAllocator(4)
    cache = core.RadixCache(2, alloc)
    with pytest.raises(ValueError, match="block ids"):
        cache.insert([1, 2, 3, 4], [0])
    with pytest.raises(ValueError, match="free"):
        cache.insert([1, 2], [3])
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(0)
    with pytest.raises(ValueError, match="handle"):
        cache.lock(99)
    with pytest.raises(ValueError):
        cache.evict(-1)


def test_planner_errors_map_to_value_key_and_runtime_errors():
    planner = _planner(vocab_size=100)
    planner.add_request(1, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="already exists"):
        planner.add_request(1, [1], 1)
    with pytest.raises(ValueError, match="out of range"):
        planner.add_request(2, [100], 1)
    with pytest.raises(ValueError, match="empty"):
        planner.add_request(2, [], 1)
    with pytest.raises(KeyError):
        planner.finish(7)
    with pytest.raises(KeyError):
        planner.request(7)
    assert planner.abort(7) is False
    with pytest.raises(RuntimeError, match="no step"):
        planner.report(0, [], [])
    step = planner.plan()
    with pytest.raises(RuntimeError, match="oldest unreported step is 0"):
        planner.report(3, [1], [5])
    with pytest.raises(RuntimeError, match="did not sample"):
        planner.report(0, [2], [5])
    with pytest.raises(ValueError, match="out of range"):
        planner.report(0, [1], [100])
    with pytest.raises(ValueError, match="1 rids but 2 tokens"):
        planner.report(0, [1], [5, 6])
    planner.report(step.step_id, [1], [5])
    assert planner.request(1)["output"] == [5]
    planner.check_invariants()


def test_a_report_must_name_the_samples_of_live_requests():
    """Regression (/tmp/core_bugs.md): leaving out a running request's sample used to let the
    core compute past the tokens it knows and read beyond its output."""
    planner = _planner(
        num_blocks=16, block_size=2, vocab_size=50, init_reserve_ratio=0.0, min_reserve_ratio=0.0
    )
    planner.add_request(1, [1, 2, 3], 8)
    s0, s1 = planner.plan(), planner.plan()
    with pytest.raises(RuntimeError, match="leaves out the sample of request 1"):
        planner.report(s0.step_id, [], [])
    assert planner.num_inflight_steps == 2
    planner.abort(1)  # an ended request's samples may be left out
    planner.report(s0.step_id, [], [])
    planner.report(s1.step_id, [], [])
    planner.check_invariants()


# -- array formats ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        [5, 6, 7, 8, 9],
        (5, 6, 7, 8, 9),
        range(5, 10),
        array("i", [5, 6, 7, 8, 9]).tobytes(),
        bytearray(array("i", [5, 6, 7, 8, 9]).tobytes()),
        memoryview(array("i", [5, 6, 7, 8, 9])),
        np.arange(5, 10, dtype=np.int32),
        np.arange(5, 10, dtype=np.int64),
    ],
    ids=["list", "tuple", "range", "bytes", "bytearray", "memoryview", "int32", "int64"],
)
def test_token_inputs_accept_sequences_and_buffers(tokens):
    planner = _planner()
    planner.add_request(1, tokens, 1)
    (entry,) = planner.plan().entries()
    assert entry["input_ids"] == [5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        (b"\x01\x00\x00", ValueError),  # not a whole number of int32
        (np.arange(4, dtype=">i4"), ValueError),  # big-endian
        (np.zeros((2, 2), dtype=np.int32), ValueError),  # 2-D
        (np.arange(4, dtype=np.float32), ValueError),  # not integers
        ([1, 2**31], ValueError),  # does not fit in int32
        ([1, "2"], TypeError),
        (5, TypeError),
    ],
)
def test_bad_token_inputs_raise(tokens, error):
    with pytest.raises(error):
        _planner().add_request(1, tokens, 1)


@pytest.mark.parametrize(
    "spans",
    [[2, 6], (2, 6), array("i", [2, 6]).tobytes(), np.array([2, 6], dtype=np.int32)],
    ids=["list", "tuple", "bytes", "int32"],
)
def test_whole_spans_accept_sequences_and_buffers(spans):
    planner = _planner(chunked_prefill_size=4)
    planner.add_request(1, list(range(10)), 1, whole_spans=spans)
    chunks = [(e["start_pos"], e["num_tokens"]) for e in planner.plan().entries()]
    assert chunks == [(0, 2)]  # [0, 4) would end inside [2, 6)


@pytest.mark.parametrize(
    ("spans", "words"),
    [
        ([1], "not [start, end) pairs"),
        ([3, 3], "whole_spans[0] = [3, 3) is not a non-empty range"),
        ([2, 11], "whole_spans[0] = [2, 11) is not a non-empty range of prompt positions"),
        ([0, 2, 1, 3], "whole_spans[1] = [1, 3) starts before the previous span ends at 2"),
        ([4, 6, 0, 1], "whole_spans[1] = [0, 1) starts before"),
    ],
)
def test_bad_whole_spans_raise_naming_the_span(spans, words):
    planner = _planner()
    with pytest.raises(ValueError, match=re.escape(words)):
        planner.add_request(1, list(range(10)), 1, whole_spans=spans)
    assert planner.num_waiting == 0


def test_a_whole_span_the_pool_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=re.escape("whole_spans[0] = [2, 10) needs positions")):
        _planner(num_blocks=2, block_size=4).add_request(1, list(range(10)), 1, whole_spans=[2, 10])


def test_each_run_of_an_images_positions_is_a_whole_span():
    def image(*positions: int) -> main_to_worker.ImageInput:
        return main_to_worker.ImageInput(
            key=b"k", positions=array("i", positions).tobytes(), tensors={}
        )

    spans = whole_spans([image(5, 6, 7, 10, 11), image(1, 2), image(12)])
    assert _i32(spans) == [1, 3, 5, 8, 10, 12, 12, 13]  # ascending; runs may touch
    assert whole_spans([image()]) == b""
    planner = _planner(chunked_prefill_size=6)
    planner.add_request(1, list(range(14)), 1, whole_spans=spans)
    assert planner.plan().entries()[0]["num_tokens"] == 5  # [0, 6) would split [5, 8)


def test_step_fields_are_packed_little_endian_arrays():
    planner = _planner(num_blocks=16, block_size=2, chunked_prefill_size=4)
    planner.add_request(10, [1, 2, 3], 4)
    planner.add_request(11, [4, 5, 6, 7, 8, 9], 4)
    step = planner.plan()
    entries = step.entries()
    assert step.num_requests == len(entries) == 2
    assert _i64(step.rids) == [10, 11]
    assert _i32(step.start_pos) == [0, 0]
    assert _i32(step.num_tokens) == [3, 4]
    assert list(step.is_decode) == [0, 0]
    assert list(step.sample) == [1, 0]
    assert _i32(step.input_ids) == [1, 2, 3, 4, 5, 6, 7]
    assert _i32(step.block_offsets) == [0, 0]
    assert _i32(step.block_counts) == [2, 2]
    assert _i32(step.block_ids) == entries[0]["block_ids"] + entries[1]["block_ids"]
    assert step.num_prefill_tokens == 7 and step.num_decode_tokens == 0
    _report_all(planner, step)
    planner.abort(11)
    step = planner.plan()
    assert _i64(step.rids) == [10]
    assert list(step.is_decode) == [1]
    assert _i64(step.dropped) == [11]
    assert step.retracted == b""

    # The wire message takes the packed fields as they are.
    wire = main_to_worker.decoder.decode(
        main_to_worker.encoder.encode(main_to_worker.step_from_plan(step))
    )
    assert wire.step_id == step.step_id and wire.rids == step.rids
    assert wire.dropped == step.dropped and wire.block_ids == step.block_ids


def test_block_states_and_refcounts_cover_the_pool():
    planner = _planner(num_blocks=8, block_size=2)
    planner.add_request(1, [1, 2, 3], 2)
    _report_all(planner, planner.plan())
    states = planner.block_states()
    refcounts = _i32(planner.refcounts())
    assert len(states) == len(refcounts) == 8
    assert sorted(states) == [0] * 6 + [1, 2]  # one cached block, one owned by the request
    assert sorted(refcounts) == [0] * 6 + [1, 2]  # the cached one is held by both
    assert _i32(planner.allocator.refcounts()) == refcounts


def test_block_ids_come_back_as_packed_int32():
    alloc = core.BlockAllocator(8)
    cache = core.RadixCache(2, alloc)
    blocks = alloc.allocate(2)
    assert isinstance(blocks, bytes) and _i32(blocks) == [0, 1]
    assert cache.insert(array("i", [1, 2, 3, 4, 5]).tobytes(), blocks) == 0
    num_tokens, block_ids, handle = cache.match_prefix(np.array([1, 2, 3, 4], dtype=np.int32))
    assert isinstance(block_ids, bytes)
    assert (num_tokens, block_ids) == (4, blocks)
    assert cache.match_prefix([9, 9]) == (0, b"", 0)
    cache.lock(handle)
    assert cache.lock_count(handle) == 1
    assert cache.stats()["cached_blocks"] == 2


def test_hot_methods_take_keywords_and_check_their_arguments():
    """match_prefix, insert, allocate, incref, decref and num_free bypass pybind11's dispatcher
    (cpp/bindings/fastcall.h); they must still behave like ordinary methods."""
    alloc = core.BlockAllocator(8)
    cache = core.RadixCache(2, alloc)
    blocks = alloc.allocate(n=2)
    assert cache.insert(block_ids=blocks, tokens=[1, 2, 3, 4]) == 0
    assert cache.match_prefix(tokens=[1, 2, 3, 4])[:2] == (4, blocks)
    alloc.incref(ids=blocks)
    alloc.decref(blocks)
    alloc.decref(ids=blocks)
    assert alloc.num_free == 6 and [alloc.refcount(b) for b in _i32(blocks)] == [1, 1]
    for call in (
        lambda: cache.match_prefix(),
        lambda: cache.match_prefix([1, 2], [3]),
        lambda: cache.match_prefix([1, 2], tokens=[1, 2]),
        lambda: cache.match_prefix(token=[1, 2]),
        lambda: cache.insert([1, 2]),
        lambda: alloc.allocate("1"),
        lambda: alloc.allocate(1.0),
        lambda: alloc.decref(5),
        lambda: core.RadixCache.match_prefix(alloc, [1, 2]),  # self of the wrong class
        lambda: core.BlockAllocator.num_free.__get__(cache),
    ):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(AttributeError):
        alloc.num_free = 3
    assert "block_ids" in core.RadixCache.match_prefix.__doc__
    alloc.check_invariants()
    cache.check_invariants()


# -- threads ----------------------------------------------------------------------------------


def test_concurrent_callers_are_serialized():
    """A scheduler thread plans and reports while another thread adds and aborts requests."""
    planner = _planner(num_blocks=256, block_size=4)
    stop = threading.Event()
    errors: list[BaseException] = []

    def scheduler() -> None:
        try:
            while not stop.is_set():
                step = planner.plan()
                if step is not None:
                    _report_all(planner, step)
        except BaseException as e:  # surfaced below
            errors.append(e)

    thread = threading.Thread(target=scheduler)
    thread.start()
    try:
        for rid in range(300):
            planner.add_request(rid, [rid % 50, 1, 2, 3, 4, 5], 8)
            if rid % 3 == 0:
                planner.abort(rid - 1)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert not errors, errors
    planner.check_invariants()


def test_long_and_short_cache_calls_from_two_threads():
    """Long match_prefix/insert calls release the GIL; short ones keep it unless the cache's
    mutex is taken, and then wait for it with the GIL released. Neither may deadlock."""
    bs, long_len = 16, 20_000  # above the release threshold (cpp/bindings/radix_cache_py.cpp)
    alloc = core.BlockAllocator(16384)  # room for all 7 long sequences: no eviction
    cache = core.RadixCache(bs, alloc)
    stop = threading.Event()
    errors: list[BaseException] = []

    def long_calls() -> None:
        try:
            for i in range(20):
                tokens = array("i", [i % 7] * bs + list(range(long_len))).tobytes()
                n, blocks, _ = cache.match_prefix(tokens)
                fresh = alloc.allocate((long_len + bs - n) // bs)
                cache.insert(tokens, blocks + fresh)
                alloc.decref(fresh)
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            stop.set()

    thread = threading.Thread(target=long_calls)
    thread.start()
    try:
        short = [1] * bs + [2] * bs
        while not stop.is_set():
            n, _, _ = cache.match_prefix(short)
            if n == 0:
                fresh = alloc.allocate(2)
                cache.insert(short, fresh)
                alloc.decref(fresh)
    finally:
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert not errors, errors
    cache.check_invariants()
    alloc.check_invariants()
