"""`pyserve run` as an operator sees it: the API key, request caps, the queue limit, a graceful
shutdown on SIGTERM, and a worker that dies mid-stream. Real servers on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from http_testlib import (
    Server,
    alive,
    child_pids,
    kv_idle,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE_ARGS = ["--dtype", "float32", "--kv-cache-tokens", "32768", "--torch-threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


def completion(max_tokens: int, stream: bool = False) -> dict:
    return {
        "prompt": "Tell me everything:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def sse_events(raw: bytes) -> list:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    return [json.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]


def test_api_key_body_cap_and_queue_limit(model_dir):
    args = ["--model", str(model_dir), *BASE_ARGS, "--api-key", KEY, "--max-request-bytes", "4096"]
    args += ["--max-running-requests", "1", "--max-queued-requests", "1"]
    with running_server(args) as server:
        url = server.url
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert request(url + "/health")[0] == 200  # open to probes
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, _, raw = request(url + "/v1/chat/completions", chat, headers=headers)
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        assert request(url + "/metrics")[0] == 401
        assert request(url + "/no/such/route")[0] == 401  # no probing for routes either
        assert request(url + "/v1/chat/completions", chat, headers=AUTH)[0] == 200

        big = {**chat, "user": "x" * 5000}
        status, _, raw = request(url + "/v1/chat/completions", big, headers=AUTH)
        assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"

        async def overload():
            async with aiohttp.ClientSession(headers=AUTH) as session:
                running = await session.post(url + "/v1/completions", json=completion(15000, True))
                first = json.loads((await running.content.readuntil(b"\n\n"))[6:])
                # one slot to run, taken: the next request waits; the one after is refused
                waiting = asyncio.create_task(
                    session.post(url + "/v1/completions", json=completion(2))
                )
                await asyncio.to_thread(
                    wait_for_metrics, url, lambda m: m["pyserve_requests_waiting"] == 1, 5, AUTH
                )
                refused = await session.post(url + "/v1/completions", json=completion(2))
                assert refused.status == 429 and refused.headers["Retry-After"]
                assert (await refused.json())["error"]["code"] == "queue_full"
                await session.post(url + "/abort_request", json={"rid": first["id"]})
                assert (await (await waiting).json())["usage"]["completion_tokens"] == 2
                running.close()

        asyncio.run(overload())
        wait_for_metrics(url, kv_idle, headers=AUTH)


def test_sigterm_refuses_new_work_finishes_in_flight_work_and_exits_0(model_dir):
    server = Server(["--model", str(model_dir), *BASE_ARGS, "--shutdown-timeout", "4"])
    url = server.url
    children = child_pids(server.proc.pid)
    assert len(children) >= 2  # the worker and the detokenizer

    async def scenario():
        async with aiohttp.ClientSession() as session:
            short = await session.post(url + "/v1/completions", json=completion(40, True))
            long = await session.post(url + "/v1/completions", json=completion(15000, True))
            await short.content.readuntil(b"\n\n")
            await long.content.readuntil(b"\n\n")
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await session.post(url + "/v1/completions", json=completion(2))
            assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
            health = await session.get(url + "/health")
            assert health.status == 503 and (await health.json())["status"] == "shutting_down"
            return await short.read(), await long.read()

    try:
        short, long = asyncio.run(scenario())
    finally:
        code = server.stop(timeout=30)
    assert code == 0, server.log()
    # the short request finished normally; the long one outlived --shutdown-timeout
    assert sse_events(short)[-1]["choices"][0]["finish_reason"] == "length"
    assert "error" in sse_events(long)[-1]
    assert not any(alive(pid) for pid in children), "a subprocess outlived the server"


def test_503_while_loading_and_a_killed_worker_fails_streams_and_exits_1(model_dir):
    server = Server(["--model", str(model_dir), *BASE_ARGS], wait_ready=False)
    url = server.url
    status, _, raw = request(url + "/health")  # the worker takes seconds to import torch
    assert status == 503 and json.loads(raw) == {"status": "loading"}
    status, _, raw = request(url + "/v1/completions", completion(2))
    assert status == 503 and json.loads(raw)["error"]["code"] == "server_not_ready"
    server.wait_ready()
    assert request(url + "/health")[0] == 200
    worker = next(
        pid
        for pid in child_pids(server.proc.pid)
        if b"pyserve.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    )

    async def scenario():
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/v1/completions", json=completion(15000, True))
            await resp.content.readuntil(b"\n\n")
            os.kill(worker, signal.SIGKILL)
            started = time.monotonic()
            raw = await resp.read()
            return raw, time.monotonic() - started

    try:
        raw, elapsed = asyncio.run(scenario())
        assert elapsed < 5
        error = sse_events(raw)[-1]["error"]
        assert error["type"] == "server_error" and "worker" in error["message"]
        server.proc.wait(15)
    finally:
        code = server.stop()
    assert code == 1, server.log()
    assert "worker" in server.log()
