"""A coroutine that runs beside the server for as long as the app does (probes, samplers)."""

from __future__ import annotations

import asyncio
import contextlib


class BackgroundTask:
    """Subclasses define ``_run``; the app's start-up calls ``start`` and its clean-up ``stop``."""

    _task: asyncio.Task | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
