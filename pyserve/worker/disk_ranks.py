"""The disk tier under ``--tp N``: each rank keeps its shard of every block (the K/V of its own
kv heads) in a tier of its own, and the ranks agree on what main hears.

Files: rank 0 opens its tier as a single worker does (``<base>/kv-<layout>/``, or a sibling
while another server holds that) and tells the others where; rank r > 0 takes ``rank<r>/`` inside
it, locked as well. One server's ranks sit together, a second server's under its own rank 0's
directory. Each rank's fingerprint names its rank and the group's size (``tier_fingerprint``),
so a shard is never read by another rank nor by a server of another ``--tp``. The tier is on
when every rank opened its own, else off on all of them.

Loads: every rank reads its own files. A block is whole only with every rank's shard, so a load
that failed on any rank failed everywhere: one all-reduce of a flag per load block gives every
rank the union, which rank 0 reports (StepTokens.failed_loads). A rank does with a block that
failed elsewhere what it does with one that failed here: nothing (main recomputes it over
whatever the pool holds).

At start, main's index names the blocks every rank holds (the intersection of the ranks'
indexes), so main never plans a load that is sure to fail, and its budget counts only whole
blocks; each rank drops its files outside the intersection, which main will never plan a load,
a drop or an eviction for. The bytes main budgets a block with are the ranks' sum:
``--disk-cache-gib`` is the server's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pyserve.worker.disk_store import (
    DiskBlockStore,
    index_dtype,
    open_store,
    open_tier,
    unpack_index,
)
from pyserve.worker.disk_tier import DiskTier, tier_fingerprint, tier_over

if TYPE_CHECKING:
    from pyserve.worker.model_runner import ModelRunner
    from pyserve.worker.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)


def rank_directory(group: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its shards, given rank 0's tier directory."""
    return group if rank == 0 else group / f"rank{rank}"


def open_rank_tier(directory: str, runner: ModelRunner, tp: TensorParallel) -> DiskTier | None:
    """This rank's tier, or None on every rank unless every rank opened its own (a collective:
    every rank calls it)."""
    try:
        fingerprint = tier_fingerprint(runner, tp_rank=tp.rank, tp_size=tp.size)
    except OSError as e:  # a model file gone: this rank cannot name its layout
        log.warning("disk KV tier: cannot fingerprint the model (%s); running without it", e)
        fingerprint = None
    store = open_rank_store(Path(directory).expanduser().absolute(), fingerprint, tp)
    return tier_over(store, runner) if store is not None else None


def open_rank_store(
    base: Path, fingerprint: bytes | None, tp: TensorParallel
) -> DiskBlockStore | None:
    """This rank's store (rank 0's under ``base``, the others' inside rank 0's), or None on
    every rank unless every rank opened its own (a collective: every rank calls it, a rank
    without a ``fingerprint`` too)."""
    store = None
    if tp.rank == 0 and fingerprint is not None:
        try:
            store = open_tier(base, fingerprint)
        except Exception as e:  # logged; the other ranks still hear (an empty directory)
            log.warning("disk KV tier: cannot use %s (%s); running without it", base, e)
    where = tp.broadcast_bytes(str(store.directory).encode() if store is not None else b"")
    if tp.rank != 0 and where and fingerprint is not None:
        directory = rank_directory(Path(where.decode()), tp.rank)
        try:
            store = open_store(directory, fingerprint)
        except Exception as e:
            log.warning("disk KV tier: rank %d cannot use %s (%s)", tp.rank, directory, e)
        else:
            if store is None:
                log.warning("disk KV tier: %s is held by another process", directory)
    if not tp.min_int(int(store is not None)):
        if store is not None:
            store.close()
        if tp.rank == 0 and where:
            log.warning("disk KV tier: a rank could not open its directory; running without it")
        return None
    return store


def agree_failed_loads(
    tp: TensorParallel, loads: Sequence[int], failed: Sequence[int]
) -> list[int]:
    """The step's load blocks that failed on any rank, in load order (a collective: every rank
    passes the step's own ``loads``)."""
    mine = set(failed)
    anywhere = tp.any_flags([block in mine for block in loads])
    return [int(block) for block, bad in zip(loads, anywhere, strict=True) if bad]


def agree_index(tp: TensorParallel, tier: DiskTier) -> tuple[bytes, int]:
    """(WorkerReady.disk_index, .disk_block_bytes) of the group: the block files every rank
    holds, and a block's bytes over all ranks. Drops this rank's files outside that index; with
    a rank that could not list its directory, the index is empty and every file stays (as a
    single worker does). A collective: every rank calls it."""
    mine = tier.listed_index()
    block_bytes = tp.sum_int(tier.block_bytes)
    if not tp.min_int(int(mine is not None)):
        return b"", block_bytes
    assert mine is not None
    common = common_index(tp.all_gather_bytes(mine), tier.block_size)
    outside = keys_outside(mine, common, tier.block_size)
    if outside:
        log.info("disk KV tier: dropping %d block files another rank does not hold", len(outside))
        tier.drop(outside)
    return common, block_bytes


def common_index(indexes: Sequence[bytes], block_size: int) -> bytes:
    """The records (key, parent, tokens) found in every packed index, in the first's order."""
    size = index_dtype(block_size).itemsize
    if not indexes:
        return b""
    for packed in indexes:
        if len(packed) % size:
            raise ValueError(f"a packed index of {len(packed)} bytes, records of {size}")
    held = [set(_records(packed, size)) for packed in indexes[1:]]
    return b"".join(r for r in _records(indexes[0], size) if all(r in h for h in held))


def keys_outside(index: bytes, common: bytes, block_size: int) -> list[int]:
    """The keys of ``index`` not in ``common``."""
    kept = {key for key, _, _ in unpack_index(common, block_size)}
    return [key for key, _, _ in unpack_index(index, block_size) if key not in kept]


def _records(packed: bytes, size: int) -> list[bytes]:
    return [packed[at : at + size] for at in range(0, len(packed), size)]
