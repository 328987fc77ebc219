"""The KV pool sized from a GPU's memory (--mem-fraction-static): the arithmetic, the settings
it is refused with, and the flag's default, all without a GPU."""

from __future__ import annotations

import pytest

from pyserve.cli import DEFAULT_MEM_FRACTION, build_parser, engine_config
from pyserve.worker.kv_cache import blocks_for_memory
from pyserve.worker.settings import WorkerSettings

GIB = 1 << 30


def test_the_pool_takes_what_the_fraction_leaves_after_what_is_in_use() -> None:
    # 140 GiB device, 20 GiB in use (weights, context): 0.9 x 140 - 20 = 106 GiB of blocks
    blocks = blocks_for_memory(140 * GIB, 120 * GIB, 0.9, block_bytes=2 * 1024 * 1024)
    assert blocks == (int(140 * GIB * 0.9) - 20 * GIB) // (2 * 1024 * 1024)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5])
def test_a_fraction_outside_0_1_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="mem_fraction_static"):
        blocks_for_memory(10 * GIB, 10 * GIB, fraction, 1024)


def test_a_model_that_fills_the_fraction_leaves_no_room_and_says_so() -> None:
    with pytest.raises(ValueError, match="no room for a KV cache"):
        blocks_for_memory(80 * GIB, 5 * GIB, 0.88, 1024)  # 75 GiB in use > 0.88 x 80


def test_the_fraction_is_for_cuda_devices_only() -> None:
    with pytest.raises(ValueError, match="CUDA device only"):
        WorkerSettings(device="cpu", mem_fraction_static=0.5).validate()
    WorkerSettings(device="cuda:0", mem_fraction_static=0.5).validate()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--device", "cuda"], DEFAULT_MEM_FRACTION),
        (["--device", "cuda", "--mem-fraction-static", "0.7"], 0.7),
        (["--device", "cuda", "--kv-cache-tokens", "4096"], None),  # sized by the user
        ([], None),  # the CPU sizes its pool in bytes
    ],
)
def test_the_flag_defaults_to_sglangs_fraction_on_cuda(argv, expected) -> None:
    args = build_parser().parse_args(["run", *argv])
    assert engine_config(args).mem_fraction_static == expected
