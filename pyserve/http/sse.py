"""Server-sent events as OpenAI writes them: ``data: <json>\\n\\n`` … ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from aiohttp import web

from pyserve.http.errors import APIError

DONE = b"data: [DONE]\n\n"


def event(payload: bytes) -> bytes:
    """One SSE event carrying an already-encoded JSON payload (never contains a newline)."""
    return b"data: " + payload + b"\n\n"


class SSEStream:
    """An event stream over one response; ``start`` sends the headers (the first byte)."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # tells nginx-style proxies not to buffer the stream
            },
        )
        self.started = False

    async def start(self) -> None:
        await self._response.prepare(self._request)
        self.started = True

    async def send(self, payload: bytes) -> None:
        if not self.started:
            await self.start()
        await self._response.write(event(payload))

    async def send_error(self, error: APIError) -> None:
        """An error after the stream began: an error event, then the terminator."""
        await self.send(error.body())
        await self.finish()

    async def finish(self) -> web.StreamResponse:
        if not self.started:
            await self.start()
        await self._response.write(DONE)
        await self._response.write_eof()
        return self._response

    @property
    def response(self) -> web.StreamResponse:
        return self._response
