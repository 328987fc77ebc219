"""Load progress, tensors and bytes done: a bar on a terminal, a line now and then in a log."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("pyserve.worker")

LOG_EVERY_S = 5.0  # a log line at most this often (and at the end)
BAR_EVERY_S = 0.2
BAR_WIDTH = 30


class LoadProgress:
    def __init__(
        self, what: str, tensors: int, nbytes: int, *, stream: TextIO | None = None
    ) -> None:
        self.what, self.tensors, self.nbytes = what, tensors, nbytes
        self.tensors_done = self.bytes_done = 0
        self.stream = sys.stderr if stream is None else stream
        self.bar = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self._shown = self.started

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self.tensors_done += tensors
        self.bytes_done += nbytes
        now = time.monotonic()
        done = self.tensors_done == self.tensors
        if done or now - self._shown >= (BAR_EVERY_S if self.bar else LOG_EVERY_S):
            self._shown = now
            self._show(done)

    def line(self) -> str:
        share = self.bytes_done / self.nbytes if self.nbytes else 1.0
        return (
            f"loading {self.what}: {self.tensors_done}/{self.tensors} tensors, "
            f"{self.bytes_done / 1e6:.0f}/{self.nbytes / 1e6:.0f} MB ({share:.0%}), "
            f"{time.monotonic() - self.started:.1f} s"
        )

    def _show(self, done: bool) -> None:
        if not self.bar:
            log.info("%s", self.line())
            return
        share = self.bytes_done / self.nbytes if self.nbytes else 1.0
        filled = int(share * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        self.stream.write(f"\r[{bar}] {self.line()}" + ("\n" if done else ""))
        self.stream.flush()
