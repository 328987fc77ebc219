"""The disk tier under ``--tp``: the index main gets names only the blocks every rank holds (each
rank drops its files outside it), a load that fails on one rank fails on all, each rank's shards
sit in a directory of its own inside rank 0's (a second server's inside its own rank 0's), and
the tier is on only where every rank opened its own. The collectives run in a real 2-rank gloo
group."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyserve.worker.disk_ranks import common_index, keys_outside
from pyserve.worker.disk_store import index_dtype, unpack_index

BLOCK = 4
HANG_GUARD_S = 120.0  # only against a hang


def packed(records: list[tuple[int, int, list[int]]]) -> bytes:
    out = np.zeros(len(records), dtype=index_dtype(BLOCK))
    for i, record in enumerate(records):
        out[i] = record
    return out.tobytes()


A, B, C, D = (1, 0, [1, 2, 3, 4]), (2, 1, [5, 6, 7, 8]), (3, 2, [9, 9, 9, 9]), (4, 0, [4, 4, 4, 4])


def test_the_common_index_holds_the_records_of_every_rank_in_rank_0s_order():
    common = common_index([packed([A, B, C, D]), packed([D, C, A]), packed([C, A, D])], BLOCK)
    assert unpack_index(common, BLOCK) == [A, C, D]
    # a record of the same key but other tokens is not the same block
    other_b = (2, 1, [5, 6, 7, 0])
    assert unpack_index(common_index([packed([A, B]), packed([A, other_b])], BLOCK), BLOCK) == [A]
    assert common_index([packed([A]), b""], BLOCK) == b""
    assert common_index([packed([A, B])], BLOCK) == packed([A, B])  # one rank: all of it
    with pytest.raises(ValueError, match="records of"):
        common_index([packed([A]), b"\x00" * 3], BLOCK)


def test_the_keys_outside_the_common_index_are_a_ranks_own():
    assert keys_outside(packed([A, B, D]), packed([A, D]), BLOCK) == [B[0]]
    assert keys_outside(packed([A]), packed([A]), BLOCK) == []
    assert keys_outside(packed([A, B]), b"", BLOCK) == [A[0], B[0]]


# One rank of a 2-rank group on the disk tier's collectives; each rank writes what it saw.
RANK_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from pyserve.worker.disk_ranks import agree_failed_loads, agree_index, open_rank_store
from pyserve.worker.disk_store import fingerprint_of, open_store, unpack_index
from pyserve.worker.disk_tier import DiskTier
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.tensor_parallel import TensorParallel

rank, init, base, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
tp = TensorParallel.join(rank, 2, init, "cpu")
fp = fingerprint_of("a shard", rank)

def tier_of(store):
    cache = PagedKVCache(
        num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32
    )
    for tensor, _ in cache.block_views():
        tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(rank)))
    return DiskTier(store, [cache], num_blocks=8, block_size=4, load_threads=1)

seen = {}
tier = tier_of(open_rank_store(base, fp, tp))
seen["directory"] = str(tier.directory)
# a chain 1 <- 2 <- 3 on both ranks; rank 0 alone holds 5, rank 1 alone 4
own = [(5, 0, [5] * 4)] if rank == 0 else [(4, 0, [4] * 4)]
blocks = [(1, 0, [1, 2, 3, 4]), (2, 1, [5, 6, 7, 8]), (3, 2, [9] * 4)] + own
tier.save([0, 1, 2, 3], [b[0] for b in blocks], [b[1] for b in blocks], [b[2] for b in blocks])
# a second server on the same directory: its ranks sit under its own rank 0's directory
second = open_rank_store(base, fp, tp)
seen["second"] = str(second.directory)
second.close()
tier.close()

# a rank whose directory another process holds: the tier is off on both
held = open_store(Path(seen["directory"]), fp) if rank == 1 else None
seen["one_held"] = open_rank_store(base, fp, tp) is None
# a rank that cannot fingerprint its layout: off on both
seen["one_unnamed"] = open_rank_store(base, None if rank else fp, tp) is None
if held is not None:
    held.close()

# a restart: the same directories; the index is what both hold, each drops the rest
tier = tier_of(open_rank_store(base, fp, tp))
seen["same_directory"] = str(tier.directory) == seen["directory"]
index, seen["block_bytes"] = agree_index(tp, tier)
seen["own_bytes"] = tier.block_bytes
seen["index"] = unpack_index(index, 4)
tier.store.wait()
seen["files"] = sorted(p.name for p in tier.directory.glob("*.kv"))

# rank 1's file of block 2 is damaged: its load fails there, and so on both ranks
if rank == 1:
    path = tier.store.path(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
tp.min_int(0)  # a barrier: rank 0 loads after the damage
seen["failed_here"] = tier.load([4, 5, 6], [1, 2, 3])
seen["failed"] = agree_failed_loads(tp, [4, 5, 6], seen["failed_here"])
seen["no_loads"] = agree_failed_loads(tp, [], [])
tier.clear()
seen["after_clear"] = sorted(p.name for p in tier.directory.glob("*.kv"))
tier.close()
with open(out, "w") as f:
    json.dump(seen, f)
tp.close()
"""


def test_two_ranks_agree_on_the_index_and_the_failed_loads(tmp_path):
    from http_testlib import free_port, run_ranks

    init = f"tcp://127.0.0.1:{free_port()}"
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    base = tmp_path / "kv-cache"
    run_ranks(
        RANK_SCRIPT, [[str(r), init, str(base), str(outs[r])] for r in range(2)], HANG_GUARD_S
    )
    zero, one = (json.loads(out.read_text()) for out in outs)
    group = Path(zero["directory"])
    assert group.parent == base and group.name.startswith("kv-")
    assert Path(one["directory"]) == group / "rank1"
    assert Path(zero["second"]) == base / f"{group.name}.1"
    assert Path(one["second"]) == base / f"{group.name}.1" / "rank1"
    assert zero["one_held"] and one["one_held"]
    assert zero["one_unnamed"] and one["one_unnamed"]
    assert zero["same_directory"] and one["same_directory"]
    chain = [[1, 0, [1, 2, 3, 4]], [2, 1, [5, 6, 7, 8]], [3, 2, [9] * 4]]
    for seen in (zero, one):
        assert seen["index"] == chain
        assert seen["block_bytes"] == 2 * seen["own_bytes"] > 0
        # each rank's own block (5 on rank 0, 4 on rank 1) was dropped
        assert seen["files"] == [f"{key:016x}.kv" for key in (1, 2, 3)]
        assert seen["failed"] == [5] and seen["no_loads"] == []
        assert seen["after_clear"] == []
    assert zero["failed_here"] == [] and one["failed_here"] == [5]
