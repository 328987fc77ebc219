"""Request priorities through a real `pyserve run --schedule-policy priority`: one running slot,
two requests of priority 5 (one running, one waiting) and then one of priority 0. The more
important request preempts the running one and finishes first; the preempted request resumes
ahead of the other priority-5 request, which arrived after it, and its output is whole. The
worker's steps are held (a test hook) until all three have reached the core, so the order
never depends on how the machine schedules the client. Every dialect takes the field and
refuses a bad one with a 400 naming it."""

from __future__ import annotations

import asyncio

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

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory, hold):
    args = ["--schedule-policy", "priority", "--max-running-requests", "1"]
    with held_tiny_server(tmp_path_factory.getbasetemp(), hold, *args) as server:
        yield server


def body(text: str, priority: int) -> dict:
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return {"text": text, "sampling_params": sampling, "priority": priority}


def test_a_more_important_request_preempts_and_the_preempted_one_resumes_first(server, hold):
    url = server.url
    done: list[str] = []

    async def generate(http: aiohttp.ClientSession, name: str, priority: int) -> dict:
        async with http.post(url + "/generate", json=body(f"{name} says", priority)) as resp:
            assert resp.status == 200, await resp.text()
            result = await resp.json()
        done.append(name)
        return result

    def in_core(n: int):
        return lambda m: m["pyserve_requests_running"] + m["pyserve_requests_waiting"] == n

    async def scenario() -> dict[str, dict]:
        async with aiohttp.ClientSession() as http:
            alone = await generate(http, "first", 5)
            done.clear()
            before = metrics(url)["pyserve_retractions_total"]
            hold.touch()
            try:
                tasks = {"first": asyncio.create_task(generate(http, "first", 5))}
                await asyncio.to_thread(wait_for_metrics, url, in_core(1))
                tasks["second"] = asyncio.create_task(generate(http, "second", 5))
                await asyncio.to_thread(wait_for_metrics, url, in_core(2))
                tasks["urgent"] = asyncio.create_task(generate(http, "urgent", 0))
                await asyncio.to_thread(wait_for_metrics, url, in_core(3))
            finally:
                hold.unlink()
            results = {name: await task for name, task in tasks.items()}
            assert metrics(url)["pyserve_retractions_total"] > before
            results["alone"] = alone
            return results

    results = asyncio.run(scenario())
    assert done == ["urgent", "first", "second"]
    for name in ("urgent", "first", "second"):
        assert len(results[name]["output_ids"]) == NEW_TOKENS
    # recomputed after its preemption, greedy: the same tokens as when it ran alone
    assert results["first"]["output_ids"] == results["alone"]["output_ids"]
    wait_for_metrics(url, kv_idle)


@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_every_dialect_takes_a_priority_and_refuses_a_bad_one(server, path):
    extra = short_generation_body(server.url, path)
    status, _, text = request(server.url + path, dict(extra, priority=-3))
    assert status == 200, text
    for bad in ("high", 1.5, 2**40):
        status, _, text = request(server.url + path, dict(extra, priority=bad))
        assert status == 400, text
        assert b"priority" in text
