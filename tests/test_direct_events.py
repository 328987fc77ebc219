"""Mid-stream SSE events written from the step callback (``RequestState.direct``,
``SSEStream.write_now``) keep every guarantee of the awaited path.

- RequestState offers a chunk to its sink only when the consumer has taken every earlier chunk,
  never a final chunk; declined or failed offers take the queue; the order of what the sink and
  the consumer see together is the order of the flushes (random schedules, checked each step);
- ``write_now`` puts on the wire exactly the bytes ``send`` puts there (raw HTTP/1.1, chunked
  framing included), declines before aiohttp has written the headers, and declines once the
  connection's send buffer is past the high-water mark, after which ``send`` drains it and the
  client still gets every byte in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from pyserve.engine.requests import RequestState
from pyserve.http.sse import DONE, HIGH_WATER, SSEStream, event
from pyserve.outputs import GenerationChunk
from pyserve.wire.detok_to_main import RequestDelta


def delta(token: int, finish: str | None = None) -> RequestDelta:
    return RequestDelta(
        rid=1, text=f"t{token} ", token_ids=struct.pack("<i", token), finish_reason=finish
    )


@pytest.mark.parametrize("seed", range(6))
def test_sink_sees_chunks_only_in_order_and_never_the_last(seed):
    rng = random.Random(seed)
    interval = rng.choice([1, 1, 3])

    async def scenario() -> None:
        state = RequestState("r", 1, prompt_tokens=4, stream_interval=interval)
        timeline: list[tuple[str, GenerationChunk]] = []  # who took which chunk, in order
        failures = {"left": rng.randrange(0, 2), "raised": 0}

        def sink(chunk: GenerationChunk) -> bool:
            assert chunk.finish_reason is None
            if rng.random() < 0.3:
                return False  # declined: the consumer gets it
            if failures["left"] and rng.random() < 0.1:
                failures["left"] -= 1
                failures["raised"] += 1
                raise RuntimeError("a broken sink")
            timeline.append(("sink", chunk))
            return True

        state.direct = sink

        async def consume() -> None:
            while True:
                chunk = await state.next_chunk()
                timeline.append(("consumer", chunk))
                if chunk.finish_reason is not None:
                    return
                for _ in range(rng.randrange(0, 3)):  # a slow consumer lets chunks queue up
                    await asyncio.sleep(0)

        consumer = asyncio.create_task(consume())
        total = rng.randrange(5, 60)
        for token in range(total):
            state.add_delta(delta(token, "length" if token == total - 1 else None), None)
            # the chunks so far, whoever took them, are the tokens so far in order
            taken = [t for _, c in timeline for t in c.token_ids]
            assert taken == list(range(len(taken)))
            for _ in range(rng.randrange(0, 3)):
                await asyncio.sleep(0)
        await asyncio.wait_for(consumer, 5)

        ids = [t for _, c in timeline for t in c.token_ids]
        assert ids == list(range(total))
        assert "".join(c.text for _, c in timeline) == "".join(f"t{t} " for t in range(total))
        assert timeline[-1][0] == "consumer" and timeline[-1][1].finish_reason == "length"
        assert [c.completion_tokens for _, c in timeline] == sorted(
            c.completion_tokens for _, c in timeline
        )
        # a sink that raised was taken out; the rest went the usual way
        assert state.direct is (None if failures["raised"] else sink)

    asyncio.run(scenario())


def test_sink_is_not_offered_while_the_consumer_is_busy_or_after_a_failure():
    async def scenario() -> None:
        state = RequestState("r", 1, prompt_tokens=1)
        offered: list[GenerationChunk] = []
        state.direct = lambda chunk: offered.append(chunk) is None
        state.add_delta(delta(0), None)  # nobody parked yet: queued
        assert offered == []
        assert (await state.next_chunk()).token_ids == [0]
        waiting = asyncio.create_task(state.next_chunk())
        await asyncio.sleep(0)  # now parked, nothing queued
        state.add_delta(delta(1), None)
        assert [c.token_ids for c in offered] == [[1]]
        state.add_delta(delta(2, "stop"), None)  # the last chunk: always the consumer's
        assert (await waiting).token_ids == [2]
        assert len(offered) == 1

        failed = RequestState("f", 2, prompt_tokens=1)
        failed.direct = lambda chunk: offered.append(chunk) is None
        failed.add_delta(delta(0), None)
        await failed.next_chunk()
        parked = asyncio.create_task(failed.next_chunk())
        await asyncio.sleep(0)
        failed.fail(RuntimeError("engine died"))
        failed.add_delta(delta(1), None)  # after the failure nothing is offered
        with pytest.raises(RuntimeError, match="engine died"):
            await parked
        assert len(offered) == 1

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------ HTTP


@contextlib.asynccontextmanager
async def serving(routes: dict) -> AsyncIterator[int]:
    """An aiohttp app with GET ``routes`` (path → handler) on a free local port; yields the port."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()


async def raw_body(port: int, path: str) -> bytes:
    """The raw bytes after the response's headers (chunked framing and all)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    return body


PAYLOADS = [b'{"a":1}', b'{"text":"\\u00e9 \\"x\\""}', b"{}", b'{"long":"' + b"y" * 5000 + b'"}']


def test_write_now_puts_on_the_wire_what_send_puts_there():
    async def awaited(request: web.Request) -> web.StreamResponse:
        sse = SSEStream(request)
        await sse.start()
        for payload in PAYLOADS * 3:
            await sse.send_frame(event(payload))
        await sse.send_frame(DONE)
        return await sse.close()

    async def direct(request: web.Request) -> web.StreamResponse:
        sse = SSEStream(request)
        await sse.start()
        assert not sse.write_now(event(PAYLOADS[0]))  # the headers are not out yet
        await sse.send_frame(event(PAYLOADS[0]))
        for payload in PAYLOADS[1:] + PAYLOADS * 2:
            assert sse.write_now(event(payload))
        await sse.send_frame(DONE)
        return await sse.close()

    async def scenario() -> None:
        async with serving({"/awaited": awaited, "/direct": direct}) as port:
            want = await raw_body(port, "/awaited")
            got = await raw_body(port, "/direct")
        assert got == want
        assert want.endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")

    asyncio.run(scenario())


def test_write_now_declines_past_the_high_water_mark_and_order_holds():
    events = [b'{"i":%d,"pad":"%s"}' % (i, b"z" * 300) for i in range(4000)]
    declined_at: list[int] = []
    release = asyncio.Event()

    async def flood(request: web.Request) -> web.StreamResponse:
        sock = request.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sse = SSEStream(request)
        await sse.start()
        await sse.send_frame(event(events[0]))
        for i, payload in enumerate(events[1:], start=1):
            if not sse.write_now(event(payload)):
                declined_at.append(i)
                assert request.transport.get_write_buffer_size() > HIGH_WATER
                release.set()
                await sse.send_frame(event(payload))  # waits for the client to drain
        await sse.send_frame(DONE)
        return await sse.close()

    async def scenario() -> None:
        async with serving({"/flood": flood}) as port:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await asyncio.wait_for(release.wait(), 10)  # not reading until the server backs up
            data = await asyncio.wait_for(reader.read(), 30)
            writer.close()
        assert declined_at, "the send buffer never passed the high-water mark"
        _, _, body = data.partition(b"\r\n\r\n")
        framed = [b"%x\r\n%b\r\n" % (len(e) + 8, b"data: " + e + b"\n\n") for e in events]
        assert body == b"".join(framed) + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"

    asyncio.run(scenario())
