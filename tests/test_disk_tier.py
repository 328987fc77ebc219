"""The disk tier's worker side: blocks saved from the KV pools come back bit for bit into other
blocks; a block whose file is missing, damaged or of another size is reported and left alone; a
save still queued loads; the fingerprint separates layouts; a Step's disk ops run before its
forward pass (a prefix loaded from disk gives the logits the same prefix gives in RAM), in a
step of their own too, and through a real worker subprocess."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from worker_testlib import (  # noqa: F401 (an autouse fixture)
    load_runner,
    make_step,
    make_tiny_llama,
    one_torch_thread,
)

from pyserve.wire import worker_to_detok as from_worker
from pyserve.wire.main_to_worker import NewRequest, SamplingParams, Shutdown, Step
from pyserve.worker.backends.triton.backend import FlatKVCache
from pyserve.worker.disk_store import (
    BlockHeader,
    index_dtype,
    open_tier,
    pack_index,
    unpack_index,
)
from pyserve.worker.disk_tier import DiskTier, open_disk_tier, tier_fingerprint
from pyserve.worker.executor import StepExecutor
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.process import _run_step

BLOCK = 4
NUM_BLOCKS = 10
KEYS = [0x1111_2222_3333_4444, 0xFFFF_0000_FFFF_0001]  # the second past int64's range


def u64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def i32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def random_cache(dtype: torch.dtype, cls: type = PagedKVCache, seed: int = 0) -> PagedKVCache:
    cache = cls(
        num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=2, head_dim=8,
        dtype=dtype,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for tensor, _ in cache.block_views():
        if tensor.dtype == torch.int8:
            tensor.copy_(torch.randint(-127, 128, tensor.shape, generator=gen, dtype=torch.int8))
        else:
            tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    return cache


def block_of(cache: PagedKVCache, block: int) -> list[torch.Tensor]:
    return [t.select(dim, block).clone() for t, dim in cache.block_views()]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def store(tmp_path):
    s = open_tier(tmp_path, b"\x01" * 32)
    assert s is not None
    yield s
    s.close()


def tier_over(store, caches: list[PagedKVCache]) -> DiskTier:
    return DiskTier(store, caches, num_blocks=NUM_BLOCKS, block_size=BLOCK, load_threads=2)


def save_two(tier: DiskTier, blocks=(3, 7)) -> None:
    tokens = [list(range(b * BLOCK, (b + 1) * BLOCK)) for b in blocks]
    tier.save(list(blocks), KEYS, [0, KEYS[0]], tokens)


# ------------------------------------------------------------------ blocks to disk and back


@pytest.mark.parametrize(
    "kind",
    ["float32", "float16", "bfloat16", "int8", "flat", "flat-int8", "with-draft"],
)
def test_saved_blocks_load_back_bit_for_bit_into_other_blocks(store, kind):
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
    dtype["flat-int8"] = torch.int8
    cls = FlatKVCache if kind.startswith("flat") else PagedKVCache
    caches = [random_cache(dtype.get(kind, torch.float32), cls)]
    if kind == "with-draft":  # the draft model's pool rides in the same payload
        caches.append(random_cache(torch.float16, seed=1))
    if kind.endswith("int8"):
        assert len(caches[0].block_views()) == 8  # K, V and both scales of each layer
    tier = tier_over(store, caches)
    assert tier.block_bytes == sum(
        t.select(d, 0).numel() * t.element_size() for c in caches for t, d in c.block_views()
    )
    originals = [[block_of(c, b) for b in (3, 7)] for c in caches]
    untouched = [block_of(c, 5) for c in caches]
    save_two(tier)
    store.wait()
    for cache in caches:
        for tensor, dim in cache.block_views():
            tensor.select(dim, 1).zero_()
            tensor.select(dim, 2).zero_()
    assert tier.load([1, 2], KEYS) == []
    for c, cache in enumerate(caches):
        assert same_bits(block_of(cache, 1), originals[c][0])
        assert same_bits(block_of(cache, 2), originals[c][1])
        assert same_bits(block_of(cache, 5), untouched[c])  # only the named blocks are written


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "wrong-size"])
def test_a_block_that_does_not_verify_is_reported_and_left_alone(store, damage):
    cache = random_cache(torch.float32)
    tier = tier_over(store, [cache])
    saved = block_of(cache, 3)
    save_two(tier)
    store.wait()
    path = store.path(KEYS[1])
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "missing":
        path.unlink()
    else:  # a whole, verified file of another payload size
        store.save(KEYS[1], 0, [1, 2, 3, 4], b"\x00" * (tier.block_bytes - 4))
        store.wait()
    for tensor, dim in cache.block_views():
        tensor.select(dim, 1).fill_(7)
        tensor.select(dim, 2).fill_(7)
    sentinel = block_of(cache, 2)
    assert tier.load([1, 2], KEYS) == [2]
    assert same_bits(block_of(cache, 1), saved)  # the good one still loads
    assert same_bits(block_of(cache, 2), sentinel)


def test_a_save_still_queued_loads(store, held_writer):
    cache = random_cache(torch.float16)
    tier = tier_over(store, [cache])
    saved = [block_of(cache, 3), block_of(cache, 7)]
    try:
        save_two(tier)
        assert not store.path(KEYS[0]).exists()
        cache.k[0].zero_()  # the forward pass may overwrite the blocks once save returns
        assert tier.load([8, 9], KEYS) == []
        assert same_bits(block_of(cache, 8), saved[0])
        assert same_bits(block_of(cache, 9), saved[1])
    finally:
        held_writer.set()
    store.wait()
    assert store.path(KEYS[0]).exists() and store.pending == 0


def test_malformed_ops_are_refused_before_anything_moves(store):
    tier = tier_over(store, [random_cache(torch.float32)])
    with pytest.raises(ValueError, match="outside the pool"):
        tier.load([NUM_BLOCKS], KEYS[:1])
    with pytest.raises(ValueError, match="outside the pool"):
        tier.save([-1], KEYS[:1], [0], [[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="loaded twice"):
        tier.load([1, 1], KEYS)
    step = make_step(0, [])
    with pytest.raises(ValueError, match="save_keys"):
        tier.apply(msgspec.structs.replace(step, save_blocks=i32([1]), save_keys=b"\x00" * 7))
    with pytest.raises(ValueError, match="save_tokens"):
        tier.apply(
            msgspec.structs.replace(
                step, save_blocks=i32([1]), save_keys=u64(KEYS[:1]), save_tokens=i32([1, 2])
            )
        )
    out_of_range = msgspec.structs.replace(
        step,
        save_blocks=i32([1]),
        save_keys=u64(KEYS[:1]),
        load_blocks=i32([NUM_BLOCKS]),
        load_keys=u64(KEYS[1:]),
    )
    with pytest.raises(ValueError, match="outside the pool"):
        tier.apply(out_of_range)  # refused before the save ran
    assert store.pending == 0 and store.index() == []


def test_apply_saves_then_loads_then_drops(store):
    cache = random_cache(torch.float32)
    tier = tier_over(store, [cache])
    saved = block_of(cache, 3)
    step = msgspec.structs.replace(
        make_step(0, []),
        save_blocks=i32([3]),
        save_keys=u64(KEYS[:1]),
        save_parents=u64([42]),
        save_tokens=i32([9, 8, 7, 6]),
        # block 3 itself is reused in this step: its save copied it out first
        load_blocks=i32([3, 4]),
        load_keys=u64([KEYS[0], 0xDEAD]),
        drop_keys=u64([KEYS[0]]),
    )
    assert tier.apply(step) == [4]
    assert same_bits(block_of(cache, 3), saved)
    assert tier.load([5], KEYS[:1]) == [5]  # dropped after the load
    store.wait()
    assert store.index() == []


def test_a_flush_clears_before_the_saves_of_its_step(store):
    """A step's saves are of blocks evicted after the flush that cleared the tier: they stay."""
    cache = random_cache(torch.float32)
    tier = tier_over(store, [cache])
    save_two(tier)  # before the flush
    store.wait()
    step = msgspec.structs.replace(
        make_step(0, []),
        clear_disk=True,
        save_blocks=i32([5]),
        save_keys=u64([0xABCD]),
        save_parents=u64([42]),
        save_tokens=i32([1, 2, 3, 4]),
    )
    assert tier.apply(step) == []
    store.wait()
    assert [h.key for h in store.index()] == [0xABCD]


def test_the_packed_index_round_trips(store):
    headers = [
        BlockHeader(KEYS[0], 7, (1, 2, 3, 4), 64),
        BlockHeader(KEYS[1], KEYS[0], (5, 6, 7, 8), 64),
        BlockHeader(3, 0, (1, 2), 64),  # a partial block: never indexed
        BlockHeader(4, 0, (1, 2, 3, 4), 65),  # another payload size
    ]
    packed = pack_index(headers, BLOCK, 64)
    assert len(packed) == 2 * index_dtype(BLOCK).itemsize == 2 * (8 + 8 + 4 * BLOCK)
    assert unpack_index(packed, BLOCK) == [
        (KEYS[0], 7, [1, 2, 3, 4]),
        (KEYS[1], KEYS[0], [5, 6, 7, 8]),
    ]
    tier = tier_over(store, [random_cache(torch.float32)])
    save_two(tier)
    store.wait()
    assert sorted(unpack_index(tier.index(), BLOCK)) == sorted(
        [(KEYS[0], 0, [12, 13, 14, 15]), (KEYS[1], KEYS[0], [28, 29, 30, 31])]
    )


# ------------------------------------------------------------------ with a model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_the_fingerprint_follows_what_determines_the_bytes(tiny_model):
    def fp(**settings) -> bytes:
        settings.setdefault("num_blocks", 8)
        settings.setdefault("block_size", BLOCK)
        return tier_fingerprint(load_runner(str(tiny_model), **settings))

    base = fp()
    assert fp() == base  # another runner of the same settings
    assert fp(num_blocks=16) == base  # the pool's size is no part of a block
    others = [
        fp(dtype="float16"),
        fp(kv_cache_dtype="float16"),
        fp(kv_cache_dtype="int8"),
        fp(block_size=8),
        fp(backend="torch"),
    ]
    assert len({base, *others}) == 1 + len(others)
    runner = load_runner(str(tiny_model), num_blocks=8, block_size=BLOCK)
    assert tier_fingerprint(runner, runner) != base  # a draft model's pool is in the payload
    # under --tp each rank's shard is its own, and no group size reads another's
    ranks = {tier_fingerprint(runner, tp_rank=r, tp_size=n) for r, n in ((0, 2), (1, 2), (0, 4))}
    assert len(ranks) == 3 and base not in ranks
    assert tier_fingerprint(runner, tp_rank=0, tp_size=1) == base
    weights = next(tiny_model.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    try:
        assert tier_fingerprint(runner) != base
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert tier_fingerprint(runner) == base


@pytest.fixture(scope="module")
def model_runner(tiny_model):
    return load_runner(str(tiny_model), num_blocks=16, block_size=BLOCK)


def executor_of(runner) -> StepExecutor:
    return StepExecutor(runner, block_size=BLOCK, eos_token_ids=[2], **runner.executor_options())


GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
PROMPT = [5, 9, 200, 31, 7, 40, 41, 42, 77]  # two whole blocks and one token


def prefill(executor: StepExecutor, rid: int, step_id: int, blocks: list[int]):
    executor.add_request(NewRequest(rid=rid, prompt_ids=i32(PROMPT), sampling=GREEDY))
    step = make_step(step_id, [{"rid": rid, "n": len(PROMPT), "ids": PROMPT, "blocks": blocks}])
    return executor.execute(step)


def test_a_prefix_loaded_in_its_step_gives_the_logits_of_the_prefix_in_ram(tmp_path, model_runner):
    tier = open_disk_tier(str(tmp_path), model_runner)
    assert tier is not None
    try:
        executor = executor_of(model_runner)
        first = prefill(executor, 1, 0, [0, 1, 2])
        parents = [0, KEYS[0]]
        tokens = [PROMPT[:BLOCK], PROMPT[BLOCK : 2 * BLOCK]]
        tier.save([0, 1], KEYS, parents, tokens)
        # the last prompt token again, over the prefix in RAM (blocks 0, 1) ...
        in_ram = prefix_step(executor, 2, 1, [0, 1, 3])
        # ... and over the prefix loaded from disk into blocks 5, 6, in the step that reads it
        for tensor, dim in model_runner.kv_cache.block_views():
            tensor.select(dim, 0).zero_()
            tensor.select(dim, 1).zero_()
        executor.add_request(NewRequest(rid=3, prompt_ids=i32(PROMPT), sampling=GREEDY))
        step = prefix_entry(3, 2, [5, 6, 7])
        step = msgspec.structs.replace(step, load_blocks=i32([5, 6]), load_keys=u64(KEYS))
        [from_disk] = _run_step(executor, step, False, tier)
        assert isinstance(from_disk, from_worker.StepTokens)
        assert from_disk.failed_loads == b""
        assert from_disk.token_ids == in_ram.token_ids == first.token_ids
        assert from_disk.logprobs == in_ram.logprobs  # bit for bit
    finally:
        tier.close()
    again = open_disk_tier(str(tmp_path), model_runner)  # a restart finds the blocks
    assert again is not None
    try:
        assert sorted(unpack_index(again.index(), BLOCK)) == sorted(
            [(KEYS[0], 0, tokens[0]), (KEYS[1], KEYS[0], tokens[1])]
        )
    finally:
        again.close()


def prefix_entry(rid: int, step_id: int, blocks: list[int]) -> Step:
    return make_step(
        step_id, [{"rid": rid, "start": 8, "n": 1, "ids": PROMPT[8:], "blocks": blocks}]
    )


def prefix_step(executor: StepExecutor, rid: int, step_id: int, blocks: list[int]):
    executor.add_request(NewRequest(rid=rid, prompt_ids=i32(PROMPT), sampling=GREEDY))
    return executor.execute(prefix_entry(rid, step_id, blocks))


def test_a_step_of_disk_ops_alone_runs_through_the_step_path(tmp_path, model_runner):
    tier = open_disk_tier(str(tmp_path), model_runner)
    assert tier is not None
    try:
        executor = executor_of(model_runner)
        executor.add_request(NewRequest(rid=9, prompt_ids=i32([5, 6]), sampling=GREEDY))
        save = msgspec.structs.replace(
            make_step(4, [], dropped=[9]),
            save_blocks=i32([0]),
            save_keys=u64(KEYS[:1]),
            save_parents=u64([0]),
            save_tokens=i32(PROMPT[:BLOCK]),
        )
        [tokens] = _run_step(executor, save, False, tier)
        assert (tokens.step_id, tokens.rids, tokens.failed_loads) == (4, b"", b"")
        assert tokens.dropped == save.dropped and len(executor.requests) == 0
        load = msgspec.structs.replace(
            make_step(5, []), load_blocks=i32([2, 3]), load_keys=u64([KEYS[0], 0xBAD])
        )
        [tokens] = _run_step(executor, load, False, tier)
        assert tokens.step_id == 5 and tokens.failed_loads == i32([3])
        # the step fails in the model after its loads ran: main still hears which failed
        broken = msgspec.structs.replace(
            make_step(6, [{"rid": 404, "n": 1, "ids": [1], "blocks": [4]}]),
            load_blocks=i32([4]),
            load_keys=u64([0xBAD]),
        )
        error, empty = _run_step(executor, broken, False, tier)
        assert isinstance(error, from_worker.WorkerError)
        assert empty.step_id == 6 and empty.failed_loads == i32([4])
        # a malformed op costs the step's loads, never the step
        garbled = msgspec.structs.replace(
            make_step(7, []), load_blocks=i32([2]), load_keys=b"\x01\x02"
        )
        [tokens] = _run_step(executor, garbled, False, tier)
        assert tokens.failed_loads == i32([2])
        # without a tier nothing loads
        [tokens] = _run_step(executor, msgspec.structs.replace(load, step_id=8), False, None)
        assert tokens.failed_loads == i32([2, 3])
    finally:
        tier.close()


def test_the_worker_runs_without_a_tier_it_cannot_hold(tmp_path, model_runner, caplog):
    from pyserve.worker.process import WorkerConfig, _open_disk_tier
    from pyserve.worker.settings import WorkerSettings

    def config(directory: Path) -> WorkerConfig:
        settings = WorkerSettings(disk_cache_dir=str(directory))
        return WorkerConfig(in_addr="", out_addr="", settings=settings)

    executor = executor_of(model_runner)
    caplog.set_level("INFO")
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"")
    assert _open_disk_tier(config(a_file), executor) is None  # an OSError: logged, not raised
    assert "running without it" in caplog.text
    held = _open_disk_tier(config(tmp_path / "disk"), executor)
    assert held is not None
    try:  # another server on the directory gets a tier of its own
        second = _open_disk_tier(config(tmp_path / "disk"), executor)
        assert second is not None and second.directory != held.directory
        second.close()
    finally:
        held.close()


def test_a_worker_subprocess_saves_and_loads(tiny_model, tmp_path):
    from test_worker_process import Ring

    disk = tmp_path / "disk"
    ipc = tempfile.mkdtemp(prefix="pyserve-disk-test-")
    ring = Ring(str(tiny_model), ipc, os.getpid())
    settings = msgspec.structs.replace(ring.config.settings, disk_cache_dir=str(disk))
    ring.config = msgspec.structs.replace(ring.config, settings=settings)
    ring.start()
    try:
        ready = ring.recv()
        assert isinstance(ready, from_worker.WorkerReady), ready
        assert ready.disk_tier.startswith(str(disk / "kv-")) and ready.disk_index == b""
        assert ready.disk_block_bytes > 0
        ring.send(NewRequest(rid=1, prompt_ids=i32(PROMPT), sampling=GREEDY))
        assert isinstance(ring.recv(), from_worker.DetokRequest)
        entry = {"rid": 1, "n": len(PROMPT), "ids": PROMPT, "blocks": [0, 1, 2]}
        ring.send(make_step(0, [entry]))
        assert isinstance(ring.recv(), from_worker.StepTokens)
        save = msgspec.structs.replace(
            make_step(1, [], dropped=[1]),
            save_blocks=i32([0, 1]),
            save_keys=u64(KEYS),
            save_parents=u64([0, KEYS[0]]),
            save_tokens=i32(PROMPT[: 2 * BLOCK]),
        )
        ring.send(save)
        done = ring.recv()
        assert isinstance(done, from_worker.StepTokens) and done.step_id == 1
        load = msgspec.structs.replace(
            make_step(2, []), load_blocks=i32([5, 6, 7]), load_keys=u64([*KEYS, 0xBAD])
        )
        ring.send(load)
        done = ring.recv()
        assert done.step_id == 2 and done.failed_loads == i32([7])
        ring.send(Shutdown())
        assert isinstance(ring.recv(), from_worker.Shutdown)
        assert ring.proc.wait(timeout=30) == 0
        [directory] = disk.iterdir()
        assert sorted(p.name for p in directory.glob("*.kv")) == sorted(
            f"{k:016x}.kv" for k in KEYS
        )
    finally:
        ring.close()


# ------------------------------------------------------------------ the wire


def test_step_from_plan_copies_the_disk_ops_the_core_step_has():
    from types import SimpleNamespace

    from pyserve.wire.main_to_worker import decoder, encoder, step_from_plan

    packed = dict.fromkeys(
        ("rids", "start_pos", "num_tokens", "is_decode", "sample", "input_ids", "block_offsets",
         "block_counts", "block_ids", "dropped"),
        b"",
    )  # fmt: skip
    older = SimpleNamespace(step_id=1, **packed)  # a core Step without disk ops
    wire = decoder.decode(encoder.encode(step_from_plan(older)))
    assert (wire.save_blocks, wire.load_keys, wire.clear_disk) == (b"", b"", False)
    ops = {
        "save_blocks": i32([3]),
        "save_keys": u64(KEYS[:1]),
        "save_parents": u64([5]),
        "save_tokens": i32([1, 2, 3, 4]),
        "load_blocks": i32([6]),
        "load_keys": u64(KEYS[1:]),
        "drop_keys": u64([9]),
    }
    wire = decoder.decode(
        encoder.encode(step_from_plan(SimpleNamespace(step_id=2, clear_disk=True, **packed, **ops)))
    )
    assert {k: getattr(wire, k) for k in ops} == ops and wire.clear_disk is True


def test_the_core_planners_saves_reach_the_wire():
    from pyserve._core import Planner
    from pyserve.wire.main_to_worker import decoder, encoder, step_from_plan

    planner = Planner(6, 2, vocab_size=100, disk_budget_blocks=8)
    saves = []
    for rid, first in ((1, 5), (2, 15)):  # the second prompt evicts the first's blocks
        planner.add_request(rid, i32(list(range(first, first + 7))), 1)
        while (plan := planner.plan()) is not None:
            wire = decoder.decode(encoder.encode(step_from_plan(plan)))
            assert (wire.save_blocks, wire.save_keys) == (plan.save_blocks, plan.save_keys)
            assert wire.drop_keys == plan.drop_keys
            saves += np.frombuffer(wire.save_blocks, dtype="<i4").tolist()
            rids = np.frombuffer(plan.rids, dtype="<i8").tolist()
            planner.report(plan.step_id, plan.rids, i32([1] * len(rids)))
            for r in rids:
                planner.finish(r)
    assert saves
