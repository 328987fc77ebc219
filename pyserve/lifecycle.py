"""Subprocess lifetime: every child of `pyserve run` dies with its parent, whatever the cause."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def signal_at_parent_death(signum: int) -> None:
    """Asks the kernel (Linux; elsewhere nothing) to send ``signum`` to this process when its
    parent dies; the request survives exec."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


_watched: set[int] = set()  # parents already watched without a cleanup


def die_with_parent(
    parent_pid: int, poll_seconds: float = 0.5, cleanup: Callable[[], None] | None = None
) -> None:
    """Exits this process when ``parent_pid`` goes away.

    On Linux the kernel sends SIGKILL at the parent's death (PR_SET_PDEATHSIG); a daemon thread
    that polls the parent's pid covers other platforms and the race where the parent died
    before the prctl call.

    With ``cleanup`` (what a killed parent could not do, such as removing its files), the kernel
    signal is not asked for, since SIGKILL would leave no chance to run it: the polling thread
    runs ``cleanup`` and exits, within ``poll_seconds`` of the parent's death. Only a process
    whose main thread does not hold the GIL for long (one that mostly waits on a socket) should
    rely on that.

    Asked again for a parent already watched without a cleanup (a worker started before its
    config, then run with it), it does nothing more.
    """
    if cleanup is None:
        if parent_pid in _watched:
            return
        _watched.add(parent_pid)
        signal_at_parent_death(signal.SIGKILL)

    def orphaned() -> None:
        if cleanup is not None:
            try:
                cleanup()
            finally:
                os._exit(1)
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                orphaned()
            time.sleep(poll_seconds)

    if os.getppid() != parent_pid:
        orphaned()
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
