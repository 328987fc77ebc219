"""Starting, watching and stopping the engine's child processes (worker, detokenizer).

Each child is ``python -m <module> --config '<json>'`` in its own session, so that a Ctrl-C in
the terminal reaches only the main process, which then stops the ring in order. Children watch
their parent themselves (``pyserve.lifecycle.die_with_parent``) in case main dies first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec

import pyserve

log = logging.getLogger("pyserve.engine")

# The directory that holds the pyserve package, so that children import the same code even when
# main found it through its working directory or sys.path rather than an installation.
_PACKAGE_ROOT = str(Path(pyserve.__file__).resolve().parent.parent)


def with_package_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this pyserve first on PYTHONPATH, for a child that must import it."""
    path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path}


class Child:
    def __init__(self, name: str, module: str, config: msgspec.Struct) -> None:
        self.name = name
        env = with_package_path(dict(os.environ))
        # OpenMP threads that spin between parallel regions steal the cores main and the
        # detokenizer need; measured on 2 cores: a decode step of 25 ms took ~1 s with spinning
        # threads under load (benchmarks/RESULTS.md, Kernels). The user's setting wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        command = [sys.executable, "-m", module, "--config", msgspec.json.encode(config).decode()]
        self.popen = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, start_new_session=True
        )
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

    def start(self, name: str, module: str, config: msgspec.Struct) -> Child:
        child = Child(name, module, config)
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
