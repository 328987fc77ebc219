"""Test-only hooks of the worker, read from its environment (the server passes its own on).

They let a test put the worker in a known state instead of racing it: held before loading the
model, held at a step until the test lets go, or slowed by a fixed sleep a step so that a
request's duration has a lower bound whatever the machine's speed. Never set them anywhere else.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("pyserve.worker")

# A path: the worker waits before loading the model for as long as that file exists.
HOLD_LOADING = "PYSERVE_TEST_HOOK_HOLD_WORKER_LOADING"
# A path: each Step waits, before its forward pass, for as long as that file exists.
HOLD_STEPS = "PYSERVE_TEST_HOOK_HOLD_WORKER_STEPS"
# Seconds: each Step sleeps this long before its forward pass.
STEP_DELAY_S = "PYSERVE_TEST_HOOK_WORKER_STEP_DELAY_S"

# A forgotten file must not hold a worker forever.
_MAX_HOLD_S = 600.0
_POLL_S = 0.01


def _hold_while_exists(path: str) -> None:
    deadline = time.monotonic() + _MAX_HOLD_S
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


class WorkerTestHooks:
    """The hooks set in the environment; each call is a no-op when its hook is unset."""

    def __init__(self, environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
        self.hold_loading = environ.get(HOLD_LOADING) or ""
        self.hold_steps = environ.get(HOLD_STEPS) or ""
        self.step_delay_s = float(environ.get(STEP_DELAY_S) or 0)
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
