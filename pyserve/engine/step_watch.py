"""The step watchdog: notices a worker stuck inside a step, and says so.

A worker that spins forever inside one forward pass stays alive, so the subprocess check never
fires; without this the server would keep answering /health 200 while nothing moves. The
scheduler thread tells the watch which Steps it sends and which come back (steps complete in the
order sent), and asks it for a verdict on its periodic check (every ``POLL_MS``), never per step.

The clock of a step starts when it reaches the head of the worker's queue: when it is sent to an
idle worker, or when the step before it completes. Overlap keeps the next Step queued behind the
running one, and its waiting there is not the worker's fault. A step unanswered for longer than
``timeout`` seconds is a stall: one ERROR line names it, and the engine answers /health with 503
until it completes (an INFO line then says how long it took). Nothing is killed and no request
fails: a slow worker that still progresses finishes its work.
"""

from __future__ import annotations

import collections
import logging
from typing import NamedTuple

log = logging.getLogger("pyserve.engine")


class Stall(NamedTuple):
    step_id: int
    num_requests: int  # the step's entries: one per request it computes
    since: float  # time.monotonic() when the worker got to it
    timeout: float

    def describe(self, now: float) -> str:
        return (
            f"step {self.step_id} ({self.num_requests} request(s)) has had no answer from the "
            f"worker for {now - self.since:.1f} s (step timeout {self.timeout:g} s)"
        )


class StepWatch:
    """Owned by the scheduler thread; ``sent`` and ``done`` are O(1), ``check`` is periodic."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # 0: never declare a stall (ages are still measured)
        self._outstanding: collections.deque[tuple[int, int]] = collections.deque()
        self._head_since = 0.0  # when the oldest outstanding step reached the worker's head
        self._last_done = 0.0
        self.stall: Stall | None = None
        self.stalls = 0  # stalls declared since start

    def sent(self, step_id: int, num_requests: int, now: float) -> None:
        if not self._outstanding:
            self._head_since = now
        self._outstanding.append((step_id, num_requests))

    def done(self, step_id: int, now: float) -> None:
        outstanding = self._outstanding
        while outstanding and outstanding[0][0] <= step_id:
            outstanding.popleft()
        self._head_since = self._last_done = now

    def oldest_age(self, now: float) -> float:
        """Seconds the oldest unanswered step has been the worker's; 0 when none is."""
        return now - self._head_since if self._outstanding else 0.0

    def check(self, now: float) -> bool:
        """Logs and returns True when the verdict changes (stalled, or recovered)."""
        changed = False
        stall, outstanding = self.stall, self._outstanding
        if stall is not None and (not outstanding or outstanding[0][0] != stall.step_id):
            log.info(
                "worker recovered after %.1f s: step %d (%d request(s)) completed",
                self._last_done - stall.since,
                stall.step_id,
                stall.num_requests,
            )
            self.stall = None
            changed = True
        if (
            self.stall is None
            and self.timeout > 0
            and outstanding
            and now - self._head_since > self.timeout
        ):
            step_id, num_requests = outstanding[0]
            self.stall = Stall(step_id, num_requests, self._head_since, self.timeout)
            self.stalls += 1
            log.error(
                "worker stalled: %s; it is alive but makes no progress (stuck, or far too slow); "
                "/health answers 503 until the step completes",
                self.stall.describe(now),
            )
            changed = True
        return changed
