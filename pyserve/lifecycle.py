"""Subprocess lifetime: every child of `pyserve run` dies with its parent, whatever the cause."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, poll_seconds: float = 0.5) -> None:
    """Exits this process when ``parent_pid`` goes away.

    On Linux the kernel sends SIGKILL at the parent's death (PR_SET_PDEATHSIG); a daemon thread
    that polls the parent's pid covers other platforms and the race where the parent died
    before the prctl call.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(poll_seconds)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
