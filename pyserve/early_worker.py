"""The model worker's process, started by the ``pyserve`` command before anything else.

A worker spends most of a start importing torch and the model code, and the main process as
long importing aiohttp, the engine and the HTTP routes before it knows the worker's config. So
``pyserve run`` first starts ``python -m pyserve.worker --config -``: that process imports what
loading needs, then waits for its WorkerConfig on stdin. The engine hands the config to it in
place of starting its first worker (``take``). When nothing takes it (a bad argument, a model
that fails main's checks), it reads end-of-file once main exits and ends.

Not for ``--dp`` (the supervisor runs no worker: each replica is a ``pyserve run`` of its own)
or ``--help``; an Engine embedded in another program starts its worker as before.
"""

from __future__ import annotations

import contextlib
import subprocess

from pyserve.spawn import start_child

_waiting: subprocess.Popen | None = None


def start(argv: list[str]) -> None:
    """Starts the worker's process for a ``pyserve run`` command line that will use one."""
    global _waiting
    if not argv or argv[0] != "run" or _waiting is not None:
        return
    for arg in argv[1:]:
        if arg in ("-h", "--help", "--dp") or arg.startswith("--dp="):
            return
    with contextlib.suppress(OSError):  # no process: the engine starts one as it always could
        _waiting = start_child("pyserve.worker", ["--config", "-"], subprocess.PIPE)


def take() -> subprocess.Popen | None:
    """The process ``start`` left waiting for its config, once; None if there is none or it has
    exited already."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is not None and waiting.poll() is not None:
        return None
    return waiting
