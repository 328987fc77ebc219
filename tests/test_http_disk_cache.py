"""The prefix cache's disk tier through a real `pyserve run`: blocks evicted from a small KV pool
are saved and loaded back for a prompt that reuses them; a clean stop saves the cached blocks,
and the next server on the same directory serves the prompt from them; a damaged file costs a
recompute, never a wrong token; /flush_cache empties the disk too. Outputs are compared with
the same prompt computed from scratch (greedy, float32 model)."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest
from http_testlib import (
    HANG_GUARD_S,
    kv_idle,
    metrics,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)

BLOCK = 16
KV_TOKENS = 256  # 16 blocks: two other 160-token prompts evict the first one's blocks
PROMPT_LEN = 160  # ten blocks; a match stops one token short of the prompt: nine
NEW_TOKENS = 8


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(PROMPT_LEN)]


def generate(url: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    status, _, raw = request(url + "/generate", body)
    assert status == 200, raw
    return json.loads(raw)


def logprobs(result: dict) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def same_output(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-3)


def block_files(state_dir: Path) -> list[Path]:
    return sorted(state_dir.glob("kv-cache/kv-*/*.kv"))


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S  # against a hang only
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp())


def server_args(model: Path, state_dir: Path) -> list[str]:
    return [
        "--model", str(model), "--dtype", "float32", "--kv-cache-tokens", str(KV_TOKENS),
        "--state-dir", str(state_dir), "--disk-cache-gib", "0.05",
        "--torch-threads", "1", "--tokenizer-workers", "1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def scratch(model, tmp_path_factory) -> dict:
    """What the prompt gives computed from scratch, on a server without the disk tier."""
    args = [*server_args(model, tmp_path_factory.mktemp("none")), "--disk-cache-gib", "0"]
    with running_server(args) as server:
        result = generate(server.url, prompt(0))
        assert result["meta_info"]["cached_tokens"] == 0
        assert metrics(server.url)["pyserve_disk_cache_budget_blocks"] == 0
        return result


def test_evicted_blocks_are_saved_and_loaded_back_with_the_same_output(model, scratch, tmp_path):
    with running_server(server_args(model, tmp_path)) as server:
        url = server.url
        first = generate(url, prompt(0))
        same_output(first, scratch)
        for seed in (1, 2):  # the pool holds one prompt: these evict the first to disk
            generate(url, prompt(seed))
        m = wait_for_metrics(url, kv_idle)
        assert m["pyserve_disk_cache_saved_blocks_total"] > 0
        assert m["pyserve_disk_cache_blocks"] > 0
        again = generate(url, prompt(0))
        assert again["meta_info"]["cached_tokens"] == (PROMPT_LEN // BLOCK - 1) * BLOCK
        same_output(again, scratch)
        m = wait_for_metrics(url, kv_idle)
        assert m["pyserve_disk_cache_loaded_blocks_total"] > 0
        assert m["pyserve_prefix_cache_disk_hit_tokens_total"] > 0
        assert m["pyserve_disk_cache_failed_loads_total"] == 0
        (tier,) = tmp_path.glob("kv-cache/kv-*")
        assert stat.S_IMODE(tier.stat().st_mode) == 0o700  # what prompts computed is private
        status, _, raw = request(url + "/server_info")
        assert status == 200, raw
        info = json.loads(raw)["disk_cache"]
        assert info["directory"] == str(tier) and info["max_bytes"] == int(0.05 * 2**30)
        assert info["budget_blocks"] == info["max_bytes"] // info["block_bytes"] > 0


def test_a_restart_serves_the_prompt_from_disk_and_flush_empties_it(model, scratch, tmp_path):
    with running_server(server_args(model, tmp_path)) as server:
        same_output(generate(server.url, prompt(0)), scratch)
    # the clean stop saved the cached blocks
    assert len(block_files(tmp_path)) >= PROMPT_LEN // BLOCK - 1
    with running_server(server_args(model, tmp_path)) as server:
        url = server.url
        m = metrics(url)
        assert m["pyserve_disk_cache_blocks"] >= PROMPT_LEN // BLOCK - 1
        restored = generate(url, prompt(0))
        assert restored["meta_info"]["cached_tokens"] == (PROMPT_LEN // BLOCK - 1) * BLOCK
        same_output(restored, scratch)
        assert metrics(url)["pyserve_disk_cache_loaded_blocks_total"] > 0
        status, _, raw = request(url + "/flush_cache", b"", method="POST")
        assert status == 200, raw
        # RAM at once; the files go with the worker's next step, which the flush makes
        wait_until(lambda: not block_files(tmp_path), "deleting the block files")
        assert metrics(url)["pyserve_disk_cache_blocks"] == 0
        assert generate(url, prompt(0))["meta_info"]["cached_tokens"] == 0


def test_damaged_block_files_cost_a_recompute_never_a_wrong_token(model, scratch, tmp_path):
    with running_server(server_args(model, tmp_path)) as server:
        generate(server.url, prompt(0))
    files = block_files(tmp_path)
    assert files
    for path in files:  # one flipped byte in each payload: the digest no longer matches
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with running_server(server_args(model, tmp_path)) as server:
        url = server.url
        result = generate(url, prompt(0))
        same_output(result, scratch)
        assert result["meta_info"]["cached_tokens"] == 0
        m = wait_for_metrics(url, kv_idle)
        assert m["pyserve_disk_cache_failed_loads_total"] > 0
        assert m["pyserve_disk_cache_loaded_blocks_total"] == 0
        # the damaged files are dropped, the prompt's blocks are in RAM now
        wait_until(lambda: not (set(block_files(tmp_path)) & set(files)), "dropping them")
        again = generate(url, prompt(0))
        assert again["meta_info"]["cached_tokens"] == (PROMPT_LEN // BLOCK - 1) * BLOCK
        same_output(again, scratch)
        assert any("failed to load" in line for line in server.lines)
