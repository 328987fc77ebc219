"""Interleaving the chunk streams of several choices (n > 1, or several prompts) into one.

Whatever ends the consumer (a finished response, an error, a disconnect that cancels the
handler), every engine generator is closed on the way out, which aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pyserve.http.metrics import RequestLatencies
from pyserve.outputs import GenerationChunk

_END = object()


async def merge_choices(
    streams: list[AsyncIterator[GenerationChunk]],
    latencies: list[RequestLatencies] | None = None,
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """Yields ``(choice index, chunk)`` as chunks arrive; an error in any stream is raised.
    ``latencies[i]``, when given, sees every chunk of stream i and is closed with it."""
    if latencies is None:
        latencies = [_Unobserved() for _ in streams]
    try:
        if len(streams) == 1:  # the common case needs no tasks and no queue
            stream, observe = streams[0], latencies[0].chunk
            try:
                async for chunk in stream:
                    observe(chunk)
                    yield 0, chunk
            finally:
                await _close(stream)
            return
        async for item in _merge_many(streams, latencies):
            yield item
    finally:
        for latency in latencies:
            latency.close()


async def _merge_many(
    streams: list[AsyncIterator[GenerationChunk]], latencies: list[RequestLatencies]
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            await _close(stream)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                latencies[index].chunk(item)
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:  # a pump cancelled before it ran never closed its stream
            await _close(stream)


class _Unobserved:
    """Stands in for RequestLatencies where nobody records them."""

    def chunk(self, chunk: GenerationChunk) -> None:
        pass

    def close(self) -> None:
        pass


async def _close(stream: AsyncIterator) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
