"""Where pyserve keeps state across restarts (the disk tier of the prefix cache): ``--state-dir``,
else ``$PYSERVE_STATE_DIR``, else ``$XDG_CACHE_HOME/pyserve``, else ``~/.cache/pyserve``."""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "PYSERVE_STATE_DIR"


def resolve_state_dir(given: str | None = None) -> Path:
    if given:
        return Path(given).expanduser()
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pyserve"
