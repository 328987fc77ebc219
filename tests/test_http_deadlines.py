"""Request deadlines through a real `pyserve run --request-timeout 1`. The deadlines cannot race
the machine: a request whose deadline passes produces no token because the worker's steps are
held (a test hook), and one that times out while generating is held after its first token with
a deadline far longer than that token takes. A storm of timing-out requests leaves the KV pool
idle."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from http_testlib import (
    GENERATION_PATHS,
    held_tiny_server,
    kv_idle,
    metrics,
    request,
    short_generation_body,
    wait_for_metrics,
)

STORM = 12
SERVER_TIMEOUT_S = 1.0
# Long against the first token of a tiny model (a guard against hangs, not a measure).
GENERATING_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory, hold):
    timeout = ["--request-timeout", str(SERVER_TIMEOUT_S)]
    with held_tiny_server(tmp_path_factory.getbasetemp(), hold, *timeout) as server:
        yield server


def chat(stream: bool, **extra) -> dict:
    messages = [{"role": "user", "content": "Tell me a long story."}]
    body = {"messages": messages, "max_tokens": 200, "ignore_eos": True, "stream": stream}
    return dict(body, **extra)


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, bytes]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.read()


def test_a_storm_of_requests_queued_past_their_deadline_gets_503s_and_leaves_kv_idle(server, hold):
    url = server.url
    generate = {"text": "Once", "sampling_params": {"max_new_tokens": 50}}

    async def storm() -> list[tuple[int, bytes]]:
        async with aiohttp.ClientSession() as http:
            bodies = [(url + "/v1/chat/completions", chat(False)) for _ in range(STORM // 2)]
            bodies += [(url + "/generate", generate) for _ in range(STORM // 2 - 1)]
            bodies.append((url + "/v1/chat/completions", chat(False, timeout=0.5)))  # its own
            return await asyncio.gather(*(post(http, u, b) for u, b in bodies))

    hold.touch()
    try:
        results = asyncio.run(storm())
    finally:
        hold.unlink()
    for status, body in results:
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout", error
    wait_for_metrics(url, kv_idle)
    assert metrics(url)["pyserve_requests_running"] == 0


def test_a_stream_queued_past_its_deadline_ends_with_the_error(server, hold):
    async def one() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as http:
            return await post(http, server.url + "/v1/chat/completions", chat(True))

    hold.touch()
    try:
        status, body = asyncio.run(one())
    finally:
        hold.unlink()
    # a 503 before the stream starts, or an error event in it
    assert b"request_timeout" in body, (status, body)
    assert status in (200, 503)
    wait_for_metrics(server.url, kv_idle)


def test_a_request_timing_out_while_generating_ends_with_what_it_has(server, hold):
    async def scenario() -> list[dict]:
        events = []
        body = chat(True, timeout=GENERATING_TIMEOUT_S)
        url = server.url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
            assert resp.status == 200
            try:
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    events.append(event)
                    if event["choices"] and event["choices"][0]["delta"].get("content"):
                        hold.touch()  # no step runs from here on: the deadline passes
            finally:
                if hold.exists():
                    hold.unlink()
        return events

    events = asyncio.run(scenario())
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "timeout"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text  # what it had when the deadline passed
    wait_for_metrics(server.url, kv_idle)


@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_every_dialect_takes_a_timeout_and_refuses_a_bad_one(server, path):
    extra = short_generation_body(server.url, path)
    # its own deadline replaces the server's second
    status, _, text = request(server.url + path, dict(extra, timeout=GENERATING_TIMEOUT_S))
    assert status == 200, text
    for bad in (0, -1, "soon", 10**9):
        status, _, text = request(server.url + path, dict(extra, timeout=bad))
        assert status == 400, text
        assert b"timeout" in text
