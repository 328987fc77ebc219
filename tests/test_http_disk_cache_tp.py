"""The prefix cache's disk tier under a real `pyserve run --tp 2`: every rank saves its shard of
an evicted block in a directory of its own, and a prompt reusing the blocks loads both shards
back with the output computed from scratch; a clean stop spills on both ranks and the next
server serves the prompt from disk; a block only one rank still holds is left out of the index
(its other rank's file deleted too); a file damaged on rank 1 alone costs a recompute of that
block and those after it, never a wrong token; /flush_cache empties both ranks' files.
Outputs are compared with the same prompts computed from scratch by the same server (greedy,
float32 model)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from http_testlib import kv_idle, metrics, request, running_server, tiny_model, wait_for_metrics
from test_http_disk_cache import (
    BLOCK,
    PROMPT_LEN,
    generate,
    prompt,
    same_output,
    server_args,
    wait_until,
)

# a block file's header (pyserve/worker/disk_store.py): magic, fingerprint, key, parent key,
# token count, payload bytes; the token ids follow
_HEADER = struct.Struct("<8s32sQQIQ")
CACHED = (PROMPT_LEN // BLOCK - 1) * BLOCK  # a match stops one token short of the prompt


def tp_args(model: Path, state_dir: Path) -> list[str]:
    return [*server_args(model, state_dir), "--tp", "2"]


def group_dir(state_dir: Path) -> Path:
    (group,) = state_dir.glob("kv-cache/kv-*")  # rank 0's tier; rank 1's lies inside it
    return group


def rank_files(state_dir: Path, rank: int) -> dict[tuple[int, ...], Path]:
    """A rank's block files by their tokens (those the worker deletes meanwhile left out)."""
    group = group_dir(state_dir)
    directory = group if rank == 0 else group / f"rank{rank}"
    found = {}
    for path in directory.glob("*.kv"):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        count = _HEADER.unpack_from(data)[4]
        found[struct.unpack_from(f"<{count}i", data, _HEADER.size)] = path
    return found


def payload_bytes(path: Path) -> int:
    return _HEADER.unpack_from(path.read_bytes())[5]


def blocks_of(seed: int) -> list[tuple[int, ...]]:
    """The tokens of each whole block of prompt(seed)."""
    ids = prompt(seed)
    return [tuple(ids[i : i + BLOCK]) for i in range(0, len(ids) - BLOCK + 1, BLOCK)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp-state")


@pytest.fixture(scope="module")
def first_run(model, state_dir) -> dict:
    """A first server: three prompts from scratch, prompt 0 evicted and loaded back, a fourth
    prompt last."""
    seen: dict = {}
    with running_server(tp_args(model, state_dir)) as server:
        url = server.url
        seen["scratch"] = [generate(url, prompt(seed)) for seed in (0, 1, 2)]
        seen["saved"] = wait_for_metrics(url, kv_idle)
        seen["again"] = generate(url, prompt(0))
        seen["loaded"] = wait_for_metrics(url, kv_idle)
        seen["last"] = generate(url, prompt(3))  # in RAM alone until the stop spills it
        status, _, raw = request(url + "/server_info")
        assert status == 200, raw
        seen["info"] = json.loads(raw)["disk_cache"]
    return seen


def test_both_ranks_shards_of_evicted_blocks_load_back_with_the_same_output(first_run, state_dir):
    scratch = first_run["scratch"]
    assert all(result["meta_info"]["cached_tokens"] == 0 for result in scratch)
    assert first_run["saved"]["pyserve_disk_cache_saved_blocks_total"] > 0
    again = first_run["again"]
    assert again["meta_info"]["cached_tokens"] == CACHED
    same_output(again, scratch[0])
    m = first_run["loaded"]
    assert m["pyserve_disk_cache_loaded_blocks_total"] > 0
    assert m["pyserve_prefix_cache_disk_hit_tokens_total"] > 0
    assert m["pyserve_disk_cache_failed_loads_total"] == 0
    # the clean stop spilled on both ranks: the same blocks, every prompt's whole, the last
    # one's included
    zero, one = rank_files(state_dir, 0), rank_files(state_dir, 1)
    assert set(zero) == set(one)
    assert {b for seed in (0, 1, 2, 3) for b in blocks_of(seed)} <= set(zero)
    assert {p.name for p in zero.values()} == {p.name for p in one.values()}
    # the server's budget counts a block's bytes on every rank
    info = first_run["info"]
    shard = payload_bytes(next(iter(zero.values())))
    assert payload_bytes(next(iter(one.values()))) == shard
    assert info["directory"] == str(group_dir(state_dir))
    assert info["block_bytes"] == 2 * shard
    assert info["budget_blocks"] == info["max_bytes"] // info["block_bytes"] > 0


def test_a_restart_serves_from_both_ranks_and_a_damaged_shard_costs_a_recompute(
    first_run, model, state_dir
):
    scratch = first_run["scratch"]
    zero, one = rank_files(state_dir, 0), rank_files(state_dir, 1)
    # prompt 2's first block is gone from rank 1: the index leaves its chain out
    lost = blocks_of(2)[0]
    one[lost].unlink()
    # prompt 1's fifth block is damaged on rank 1 only
    damaged = blocks_of(1)[4]
    data = bytearray(one[damaged].read_bytes())
    data[len(data) // 2] ^= 0xFF
    one[damaged].write_bytes(bytes(data))
    chain2 = [b for b in blocks_of(2) if b in zero]
    with running_server(tp_args(model, state_dir)) as server:
        url = server.url
        assert metrics(url)["pyserve_disk_cache_blocks"] == len(zero) - len(chain2)
        restored = generate(url, prompt(0))
        assert restored["meta_info"]["cached_tokens"] == CACHED
        same_output(restored, scratch[0])
        m = wait_for_metrics(url, kv_idle)
        assert m["pyserve_disk_cache_loaded_blocks_total"] > 0
        assert m["pyserve_prefix_cache_disk_hit_tokens_total"] > 0
        assert m["pyserve_disk_cache_failed_loads_total"] == 0
        # the chain left out is deleted on both ranks (rank 0's first block at start)
        wait_until(
            lambda: (
                not set(chain2) & (set(rank_files(state_dir, 0)) | set(rank_files(state_dir, 1)))
            ),
            "deleting the chain one rank lacks",
        )

        partial = generate(url, prompt(1))
        assert partial["meta_info"]["cached_tokens"] == 4 * BLOCK  # the blocks before the damage
        same_output(partial, scratch[1])
        m = wait_for_metrics(url, kv_idle)
        # counted from the damaged block on: the rest of the prefix is recomputed too
        assert m["pyserve_disk_cache_failed_loads_total"] == CACHED // BLOCK - 4
        # that block's files (and those after it) go on both ranks
        after = set(blocks_of(1)[4:])
        wait_until(
            lambda: not after & (set(rank_files(state_dir, 0)) | set(rank_files(state_dir, 1))),
            "dropping the failed block's files",
        )
        assert any("failed to load" in line for line in server.lines)

        recomputed = generate(url, prompt(2))
        assert recomputed["meta_info"]["cached_tokens"] == 0
        same_output(recomputed, scratch[2])

        status, _, raw = request(url + "/flush_cache", b"", method="POST")
        assert status == 200, raw
        wait_until(
            lambda: not rank_files(state_dir, 0) and not rank_files(state_dir, 1),
            "deleting both ranks' block files",
        )
        m = wait_for_metrics(url, kv_idle)
        assert m["pyserve_disk_cache_blocks"] == 0
