"""`pyserve run` as an operator sees it: the API key, request caps, the queue limit, a graceful
shutdown on SIGTERM, and a worker that dies mid-stream. Real servers on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
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

from pyserve.testing.worker_hooks import HOLD_LOADING, STEP_DELAY_S

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE_ARGS = ["--dtype", "float32", "--kv-cache-tokens", "32768", "--torch-threads", "1"]
HANG_GUARD_S = 60.0  # only against a hang: the waits below end on what the server does


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
                one_waiting = lambda m: m["pyserve_requests_waiting"] == 1  # noqa: E731
                await asyncio.to_thread(wait_for_metrics, url, one_waiting, headers=AUTH)
                refused = await session.post(url + "/v1/completions", json=completion(2))
                assert refused.status == 429 and refused.headers["Retry-After"]
                assert (await refused.json())["error"]["code"] == "queue_full"
                await session.post(url + "/abort_request", json={"rid": first["id"]})
                assert (await (await waiting).json())["usage"]["completion_tokens"] == 2
                running.close()

        asyncio.run(overload())
        wait_for_metrics(url, kv_idle, headers=AUTH)


# Each worker step sleeps this long first, so that the long request needs at least
# 15000 x 10 ms = 150 s, far past --shutdown-timeout, however fast the machine; the short one's
# 40 steps need 0.4 s and its compute, far within it.
STEP_DELAY = "0.01"
SHUTDOWN_TIMEOUT = "8"


def test_sigterm_refuses_new_work_finishes_in_flight_work_and_exits_0(model_dir, monkeypatch):
    monkeypatch.setenv(STEP_DELAY_S, STEP_DELAY)  # the server inherits it
    server = Server(["--model", str(model_dir), *BASE_ARGS, "--shutdown-timeout", SHUTDOWN_TIMEOUT])
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
            while True:  # until the server has taken the signal
                health = await session.get(url + "/health")
                if (await health.json())["status"] != "ok":
                    break
                await asyncio.sleep(0.02)
            assert health.status == 503 and (await health.json())["status"] == "shutting_down"
            refused = await session.post(url + "/v1/completions", json=completion(2))
            assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
            return await short.read(), await long.read()

    try:
        short, long = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    finally:
        code = server.stop(timeout=HANG_GUARD_S)
    assert code == 0, server.log()
    # the short request finished normally; the long one outlived --shutdown-timeout
    assert sse_events(short)[-1]["choices"][0]["finish_reason"] == "length"
    assert "error" in sse_events(long)[-1]
    assert not any(alive(pid) for pid in children), "a subprocess outlived the server"


def test_503_while_loading_and_a_killed_worker_fails_streams_and_exits_1(
    model_dir, tmp_path, monkeypatch
):
    hold = tmp_path / "hold-loading"
    hold.touch()  # the worker waits before loading the model while this file exists
    monkeypatch.setenv(HOLD_LOADING, str(hold))  # the server inherits it
    server = Server(["--model", str(model_dir), *BASE_ARGS], wait_ready=False)
    url = server.url
    try:
        status, _, raw = request(url + "/health")
        assert status == 503 and json.loads(raw) == {"status": "loading"}
        status, _, raw = request(url + "/v1/completions", completion(2))
        assert status == 503 and json.loads(raw)["error"]["code"] == "server_not_ready"
    finally:
        hold.unlink()
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
            return await resp.read()  # ends on the kill, long before its 15000 tokens

    try:
        raw = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
        error = sse_events(raw)[-1]["error"]
        assert error["type"] == "server_error" and "worker" in error["message"]
        server.proc.wait(HANG_GUARD_S)
    finally:
        code = server.stop()
    assert code == 1, server.log()
    assert "worker" in server.log()
