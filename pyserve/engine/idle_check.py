"""The idle self-check: once nothing has run for a moment, every account must be back at rest.

At rest means: every KV block is free or held by the prefix cache (free + cached == total), the
core knows no request and its invariants hold, the scheduler thread tracks no live request, the
worker and the detokenizer hold no request state (as of the last step they reported), and no
request state on the event loop still waits for output the core will never produce. Anything
else is a leak that would slowly eat the KV pool or memory, so it is logged as an error (and
counted in /metrics) instead of going unnoticed.

The check runs once after each busy spell, ``IDLE_AFTER_S`` after the last activity: the core
part on the scheduler thread (which owns the Planner), the request states on the event loop.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("pyserve.engine")

IDLE_AFTER_S = 1.0

# Tests only: take this many blocks out of the KV pool behind the core's back, so that a test can
# see the check fire on a real server (pyserve/testing/engine_hooks.py). Never set it elsewhere.
TEST_HOOK_LEAK_KV_BLOCKS = "PYSERVE_TEST_HOOK_LEAK_KV_BLOCKS"


class IdleWatch:
    """Says when the check is due: once after each spell of work, once quiet for a while."""

    def __init__(self, quiet_seconds: float = IDLE_AFTER_S) -> None:
        self._quiet_seconds = quiet_seconds
        self._last_activity = 0.0
        self._due = False

    def activity(self, now: float) -> None:
        self._last_activity = now

    def request_ended(self) -> None:
        self._due = True

    def check_now(self, now: float, idle: bool) -> bool:
        if self._due and idle and now - self._last_activity >= self._quiet_seconds:
            self._due = False
            return True
        return False


def core_problems(
    planner: Any, *, live_requests: int, worker_requests: int, detokenizer_requests: int
) -> list[str]:
    """What is off in the scheduler's accounts while nothing runs (scheduler thread only)."""
    stats = planner.stats()
    problems = []
    free, cached, total = stats["num_free_blocks"], stats["cached_blocks"], planner.num_blocks
    if free + cached != total:
        problems.append(f"KV blocks: {free} free + {cached} cached != {total} in the pool")
    counts = {
        "requests known to the core": stats["num_requests"],
        "running requests in the core": stats["num_running"],
        "waiting requests in the core": stats["num_waiting"],
        "live requests on the scheduler thread": live_requests,
        "requests with worker state": worker_requests,
        "requests with detokenizer state": detokenizer_requests,
    }
    problems += [f"{count} {what}" for what, count in counts.items() if count]
    try:
        planner.check_invariants()
    except RuntimeError as e:
        problems.append(f"core invariant broken: {e}")
    return problems


def unfinished_states(states: Any, last_submitted_rid: int) -> list[str]:
    """Request states that the core has seen but that still wait for output, although the core
    is idle (event loop only). Later rids arrived after the check began and do not count."""
    stuck = [s for s in states if not s.finished and s.core_rid <= last_submitted_rid]
    if not stuck:
        return []
    return [f"{len(stuck)} request state(s) waiting for output that will never come"]


def apply_test_hook(planner: Any) -> None:
    """Leaks ``$PYSERVE_TEST_HOOK_LEAK_KV_BLOCKS`` blocks from the pool (tests only)."""
    count = int(os.environ.get(TEST_HOOK_LEAK_KV_BLOCKS) or 0)
    if count > 0:
        from pyserve.testing.engine_hooks import leak_kv_blocks

        leak_kv_blocks(planner, count)
