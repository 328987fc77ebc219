"""Starting, watching and stopping the engine's child processes (worker, detokenizer).

Each child is ``python -m <module> --config '<json>'`` in its own session (pyserve/spawn.py),
so that a Ctrl-C in the terminal reaches only the main process, which then stops the ring in
order; the ``pyserve`` command's worker was started before (pyserve/early_worker.py). Children watch
their parent themselves (``pyserve.lifecycle.die_with_parent``) in case main dies first.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time

import msgspec

from pyserve.spawn import start_child

log = logging.getLogger("pyserve.engine")


class Child:
    def __init__(
        self,
        name: str,
        module: str,
        config: msgspec.Struct,
        started: subprocess.Popen | None = None,
    ) -> None:
        """Starts ``python -m <module> --config '<json>'``; or, with ``started``, hands the
        config to that process, already running ``--config -`` and waiting for it on stdin."""
        self.name = name
        encoded = msgspec.json.encode(config)
        if started is None:
            self.popen = start_child(module, ["--config", encoded.decode()], subprocess.DEVNULL)
        else:
            self.popen = started
            assert started.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died: seen as a dead child
                started.stdin.write(encoded + b"\n")
                started.stdin.close()
        self.pid = self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def describe_exit(self) -> str:
        code = self.popen.poll()
        if code is None:
            return f"the {self.name} process (pid {self.pid}) is running"
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the {self.name} process (pid {self.pid}) {how}"


class Children:
    """The engine's children, in start order."""

    def __init__(self) -> None:
        self.items: list[Child] = []

    def start(
        self,
        name: str,
        module: str,
        config: msgspec.Struct,
        started: subprocess.Popen | None = None,
    ) -> Child:
        child = Child(name, module, config, started)
        self.items.append(child)
        log.debug("started %s (pid %d)", name, child.pid)
        return child

    def first_dead(self) -> Child | None:
        return next((c for c in self.items if c.returncode is not None), None)

    def wait(self, timeout: float) -> bool:
        """Waits until all have exited; False if some are still running at the deadline."""
        deadline = time.monotonic() + timeout
        for child in self.items:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL for any still alive after ``grace`` seconds; reaps them all."""
        alive = [c for c in self.items if c.returncode is None]
        for child in alive:
            with contextlib.suppress(ProcessLookupError):
                child.popen.terminate()
        if not self.wait(grace):
            for child in alive:
                if child.returncode is None:
                    log.warning("%s did not stop on SIGTERM; killing it", child.name)
                    with contextlib.suppress(ProcessLookupError):
                        child.popen.kill()
            self.wait(grace)
