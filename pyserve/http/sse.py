"""Server-sent events: frames of ``data: <json>\\n\\n`` (OpenAI ends them with
``data: [DONE]``), or ``event: <name>\\ndata: <json>\\n\\n`` (the Responses and Messages APIs
name each event)."""

from __future__ import annotations

import asyncio

from aiohttp import web

DONE = b"data: [DONE]\n\n"
# Past this many bytes waiting in a connection's send buffer, write_now declines and events take
# the awaited path, which waits for the client to catch up (aiohttp's writer drains at 64 KiB).
HIGH_WATER = 0x10000


def event(payload: bytes, name: bytes | None = None) -> bytes:
    """One SSE frame carrying an already-encoded JSON payload (never contains a newline)."""
    if name is None:
        return b"data: " + payload + b"\n\n"
    return b"event: " + name + b"\ndata: " + payload + b"\n\n"


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
        # write_now may write straight to the transport once aiohttp has written the headers
        # (it holds them back until the first body write) and only if the body is plain
        # HTTP/1.1 chunks; looked up at the first send
        self._transport: asyncio.Transport | None = None
        self._wrote = False

    async def start(self) -> None:
        await self._response.prepare(self._request)
        self.started = True

    async def send_frame(self, frame: bytes) -> None:
        """Writes one frame (``event``), starting the response if needed."""
        if not self.started:
            await self.start()
        await self._response.write(frame)
        if not self._wrote:
            self._wrote = True
            self._transport = self._direct_transport()

    def write_now(self, frame: bytes) -> bool:
        """Writes one frame at once, without awaiting, if the connection can take it; False
        (nothing written) when it cannot: before the first ``send_frame``, on a connection that
        is closing or whose send buffer is past HIGH_WATER, or a response that is not plain
        chunked HTTP/1.1. The bytes on the wire are the ones ``send_frame`` writes."""
        transport = self._transport
        if (
            transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() > HIGH_WATER
        ):
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(frame), frame))  # one HTTP/1.1 chunk
        return True

    def _direct_transport(self) -> asyncio.Transport | None:
        response = self._response
        # prepare() decided the framing: plain chunks unless HTTP/1.0 or compression
        if response.headers.get("Transfer-Encoding") != "chunked" or response.compression:
            return None
        return self._request.transport  # type: ignore[return-value]  (uvloop's is no subclass)

    async def close(self) -> web.StreamResponse:
        """Ends the response (after the dialect's own terminator, if it has one)."""
        if not self.started:
            await self.start()
        await self._response.write_eof()
        return self._response

    @property
    def response(self) -> web.StreamResponse:
        return self._response
