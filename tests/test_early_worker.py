"""The worker's process started by the ``pyserve`` command before its imports
(pyserve/early_worker.py): used as the engine's worker, and gone when nothing uses it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pyserve import early_worker

HANG_GUARD_S = 120.0  # only against a hang


def processes_with_env(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass  # it ended while we looked, or is not ours to read
    return found


@pytest.mark.parametrize(
    "argv, starts",
    [
        (["run", "--model", "m.gguf"], True),
        (["run", "--help"], False),
        (["run", "--dp", "2"], False),
        (["run", "--dp=2"], False),
        (["chat"], False),
        ([], False),
    ],
)
def test_only_a_run_that_will_use_a_worker_starts_one(monkeypatch, argv, starts):
    started: list[list[str]] = []
    monkeypatch.setattr(early_worker, "_waiting", None)
    monkeypatch.setattr(
        early_worker, "start_child", lambda module, args, stdin: started.append(args) or _Exited()
    )
    early_worker.start(argv)
    assert started == ([["--config", "-"]] if starts else [])
    assert early_worker.take() is None  # an exited one is never handed out
    assert early_worker.take() is None


class _Exited:
    def poll(self) -> int:
        return 0


def test_an_unused_early_worker_ends_with_the_command():
    marker = f"PYSERVE_TEST_MARK={uuid.uuid4().hex}"
    key, value = marker.split("=")
    proc = subprocess.run(
        [sys.executable, "-m", "pyserve", "run", "--model", "/no/such/model.gguf", "--port", "0"],
        env={**os.environ, key: value},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode != 0 and "no such file" in proc.stderr, proc.stderr
    deadline = time.monotonic() + HANG_GUARD_S
    while left := processes_with_env(marker):
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.1)


def test_the_worker_reads_its_config_on_stdin_and_ends_quietly_at_end_of_file():
    proc = subprocess.run(
        [sys.executable, "-m", "pyserve.worker", "--config", "-"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
