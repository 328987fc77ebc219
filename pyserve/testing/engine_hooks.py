"""Test-only hooks of the engine, switched on from the server's environment (the switch is
named and read in pyserve/engine/idle_check.py). Never set them anywhere else."""

from __future__ import annotations

import logging
from typing import Any

from pyserve.engine.idle_check import TEST_HOOK_LEAK_KV_BLOCKS

__all__ = ["TEST_HOOK_LEAK_KV_BLOCKS", "leak_kv_blocks"]

log = logging.getLogger("pyserve.engine")


def leak_kv_blocks(planner: Any, count: int) -> None:
    """Takes ``count`` blocks out of the KV pool behind the core's back, so that a test can see
    the idle check fire on a real server."""
    planner.allocator.allocate(count)
    log.warning("test hook %s: %d KV block(s) leaked on purpose", TEST_HOOK_LEAK_KV_BLOCKS, count)
