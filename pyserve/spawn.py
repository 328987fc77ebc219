"""How pyserve starts its Python child processes: the command, the environment, the session.

Standard library only: the ``pyserve`` command starts the model worker with it before it imports
anything else (pyserve/early_worker.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The directory that holds the pyserve package, so that children import the same code even when
# main found it through its working directory or sys.path rather than an installation.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def with_package_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this pyserve first on PYTHONPATH, for a child that must import it."""
    path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path}


def start_child(module: str, args: list[str], stdin: int) -> subprocess.Popen:
    """``python -m <module> <args>`` in its own session, so that a Ctrl-C in the terminal reaches
    only the main process, which then stops the ring in order."""
    env = with_package_path(dict(os.environ))
    # OpenMP threads that spin between parallel regions steal the cores main and the
    # detokenizer need: on a small machine under load a decode step took many times longer
    # with spinning threads (benchmarks/RESULTS.md, Kernels). The user's setting wins.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    command = [sys.executable, "-m", module, *args]
    return subprocess.Popen(command, env=env, stdin=stdin, start_new_session=True)
