"""Test-only hooks of the worker, switched on from its environment (the server passes its own
on; pyserve/worker/env.py names and reads the switches).

They let a test put the worker in a known state instead of racing it: held before loading the
model, held at a step until the test lets go, or slowed by a fixed sleep a step so that a
request's duration has a lower bound whatever the machine's speed. Never set them anywhere else.
"""

from __future__ import annotations

import logging
import os
import time

from pyserve.worker.env import HOLD_LOADING, HOLD_STEPS, STEP_DELAY_S, HookSwitches

__all__ = ["HOLD_LOADING", "HOLD_STEPS", "STEP_DELAY_S", "WorkerTestHooks"]

log = logging.getLogger("pyserve.worker")

# A forgotten file must not hold a worker forever.
_MAX_HOLD_S = 600.0
_POLL_S = 0.01


def _hold_while_exists(path: str) -> None:
    deadline = time.monotonic() + _MAX_HOLD_S
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


class WorkerTestHooks:
    """The hooks that ``switches`` set; each call is a no-op when its hook is unset."""

    def __init__(self, switches: HookSwitches) -> None:
        self.hold_loading = switches.hold_loading
        self.hold_steps = switches.hold_steps
        self.step_delay_s = switches.step_delay_s
        for name, value in (
            (HOLD_LOADING, self.hold_loading),
            (HOLD_STEPS, self.hold_steps),
            (STEP_DELAY_S, self.step_delay_s),
        ):
            if value:
                log.warning("test hook %s=%s is set", name, value)

    def before_loading(self) -> None:
        if self.hold_loading:
            _hold_while_exists(self.hold_loading)

    def before_step(self) -> None:
        if self.hold_steps:
            _hold_while_exists(self.hold_steps)
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
