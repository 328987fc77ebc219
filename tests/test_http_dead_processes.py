"""Processes of a real `pyserve run` dying under it: a SIGKILLed detokenizer fails every request
in flight at once and the server exits 1 naming it; a SIGKILLed main process takes its worker
and detokenizer with it and leaves no IPC files. (A SIGKILLed worker: test_http_lifecycle.)"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from http_testlib import Server, alive, child_pids, tiny_model

from pyserve.testing.worker_hooks import HOLD_LOADING

BASE_ARGS = ["--dtype", "float32", "--kv-cache-tokens", "32768", "--torch-threads", "1"]
# Only against a hang: every wait below ends on what the processes do, not on a clock.
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


def completion(max_tokens: int, stream: bool) -> dict:
    body = {"prompt": "Tell me everything:", "max_tokens": max_tokens, "temperature": 0}
    return {**body, "ignore_eos": True, "stream": stream}


def child(server: Server, module: str, timeout: float = HANG_GUARD_S) -> int:
    """The pid of the server's subprocess running ``python -m <module>``. Waits for it: between
    fork and exec a child still shows its parent's command line."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in child_pids(server.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:  # gone meanwhile
                continue
            if module.encode() in cmdline.split(b"\0"):
                return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"no {module} process under {server.proc.pid}")
        time.sleep(0.02)


def wait_dead(pids: list[int], timeout: float) -> float:
    """Seconds until none of ``pids`` is alive; fails after ``timeout``."""
    started = time.monotonic()
    while any(alive(pid) for pid in pids):
        assert time.monotonic() - started < timeout, f"still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_killed_detokenizer_fails_every_request_and_the_server_exits_1(model_dir):
    # One request runs; two more wait behind it, so that they have no first token yet.
    server = Server(["--model", str(model_dir), *BASE_ARGS, "--max-running-requests", "1"])
    url = server.url
    worker, detokenizer = child(server, "pyserve.worker"), child(server, "pyserve.detokenizer")

    async def watch_health(statuses: list[tuple[int, str]]) -> None:
        """Polls /health until the server stops answering."""
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(url + "/health") as resp:
                        statuses.append((resp.status, (await resp.json())["status"]))
                except aiohttp.ClientError:
                    return
                await asyncio.sleep(0.02)

    async def waiting_requests(session: aiohttp.ClientSession) -> float:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
        return float(re.search(r"^pyserve_requests_waiting (\S+)$", text, re.MULTILINE).group(1))

    async def scenario():
        guard = aiohttp.ClientTimeout(total=HANG_GUARD_S)
        async with aiohttp.ClientSession(timeout=guard) as session:
            running = await session.post(url + "/v1/completions", json=completion(15000, True))
            await running.content.readuntil(b"\n\n")
            queued = [
                asyncio.create_task(session.post(url + "/v1/completions", json=completion(8, s)))
                for s in (True, False)
            ]
            while await waiting_requests(session) < 2:  # both reach the engine's queue
                await asyncio.sleep(0.02)
            os.kill(detokenizer, signal.SIGKILL)
            statuses: list[tuple[int, str]] = []
            health = asyncio.create_task(watch_health(statuses))
            stream = await running.read()
            answers = [(r.status, await r.json()) for r in await asyncio.gather(*queued)]
            await health
            return stream, answers, statuses

    try:
        # every request ends on the kill (the stream would run for 15000 tokens otherwise)
        stream, answers, statuses = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
        code = server.proc.wait(HANG_GUARD_S)
    finally:
        server.stop()
    # inside the stream: an error event, then the terminator
    assert stream.endswith(b"data: [DONE]\n\n")
    error = json.loads(stream.split(b"\n\n")[-3][len(b"data: ") :])["error"]
    assert error["type"] == "server_error" and "detokenizer" in error["message"]
    # before a stream started: a plain 5xx with the OpenAI error body, streaming or not
    for status, body in answers:
        assert status >= 500 and "detokenizer" in body["error"]["message"], (status, body)
    assert (503, "unhealthy") in statuses, statuses
    assert code == 1, server.log()
    assert re.search(
        rf"detokenizer process \(pid {detokenizer}\) was killed by signal 9", server.log()
    )
    wait_dead([worker], HANG_GUARD_S)


def ipc_directory(pid: int) -> Path:
    """The ring's IPC directory, read from a child's command line (its JSON config)."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    match = re.search(r'"in_addr":"ipc://([^"]+)/[a-z]+"', cmdline)
    assert match, cmdline
    return Path(match.group(1))


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass  # it ended while we looked
    return found


def engine_children(server: Server, timeout: float = HANG_GUARD_S) -> list[int]:
    """The worker and the detokenizer, once the engine has started both."""
    deadline = time.monotonic() + timeout
    while len(children := child_pids(server.proc.pid)) < 2:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.02)
    return children


@pytest.mark.parametrize("when", ["loading", "serving"])
def test_a_killed_main_process_takes_its_children_and_ipc_files_with_it(
    model_dir, when, tmp_path, monkeypatch
):
    if when == "loading":  # the worker is held before loading the model until the kill
        hold = tmp_path / "hold-loading"
        hold.touch()
        monkeypatch.setenv(HOLD_LOADING, str(hold))  # the server inherits it
    server = Server(["--model", str(model_dir), *BASE_ARGS], wait_ready=when == "serving")
    children = engine_children(server)
    # the worker was started before main knew its config, which it reads on stdin (the
    # detokenizer's command line holds the ring's addresses)
    ipc = ipc_directory(child(server, "pyserve.detokenizer"))
    assert child(server, "pyserve.worker") in children
    assert set(processes_mentioning(str(ipc))) <= set(children)

    async def kill_mid_stream():
        async with aiohttp.ClientSession() as session:
            running = await session.post(
                server.url + "/v1/completions", json=completion(15000, True)
            )
            await running.content.readuntil(b"\n\n")  # the worker is busy computing
            server.proc.kill()
            with pytest.raises(aiohttp.ClientError):
                await running.read()

    try:
        if when == "serving":
            asyncio.run(kill_mid_stream())
        else:  # the worker is held before loading the model
            assert ipc.is_dir()
            server.proc.kill()
        assert server.proc.wait(HANG_GUARD_S) == -signal.SIGKILL
        wait_dead(children, HANG_GUARD_S)
    finally:
        server.stop()
    if when == "loading":
        assert "pyserve is ready" not in server.log()
    assert processes_mentioning(str(ipc)) == [], "an orphan outlived the main process"
    assert not ipc.exists(), f"IPC files left behind: {list(ipc.iterdir())}"
