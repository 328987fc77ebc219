"""Noticing clients that went away, so that their requests are aborted promptly.

aiohttp does not cancel a handler when its client disconnects (unless the server was started
with ``handler_cancellation=True``, which an application embedding pyserve may not do), and a
handler that is waiting for its first token never writes, so it would not notice. One task polls
the transports of all watched requests and cancels the handler of any whose connection closed;
the cancellation closes the engine's generator, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from aiohttp import web

POLL_SECONDS = 0.02


class DisconnectWatcher:
    def __init__(self, poll_seconds: float = POLL_SECONDS) -> None:
        self._poll_seconds = poll_seconds
        # task → its connection's transport, taken once: a request's transport never changes,
        # and reading it through request.transport at every poll of every request costs more
        # than the poll itself (it showed in profiles at 256 streams)
        self._watched: dict[asyncio.Task, asyncio.BaseTransport | None] = {}
        self._poller: asyncio.Task | None = None

    @contextlib.contextmanager
    def watch(self, request: web.Request) -> Iterator[None]:
        """While inside, the current task is cancelled if ``request``'s client disconnects."""
        task = asyncio.current_task()
        assert task is not None
        self._watched[task] = request.transport
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            yield
        finally:
            self._watched.pop(task, None)

    async def _poll(self) -> None:
        while self._watched:
            await asyncio.sleep(self._poll_seconds)
            for task, transport in list(self._watched.items()):
                if transport is None or transport.is_closing():
                    del self._watched[task]
                    task.cancel()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
