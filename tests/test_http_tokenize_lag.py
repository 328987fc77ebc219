"""Tokenization must not block the event loop: while 8 chat requests with ~8k-token prompts are
templated and tokenized, the server's own event-loop lag probe (/metrics,
``pyserve_event_loop_lag_seconds``) records no stall of 50 ms or more, and /health keeps
answering. A loop that froze delays the probe's sleep, which records the freeze as its lag when
it wakes; so the verdict waits until the probe has completed two more sleeps after the scenario
(the one under way at its end, and one after): a probe that died cannot pass as "no stall".
Nothing is judged by how long the scenario took. A real `pyserve run` on the tiny model, so that
compute does not dominate; the prompts share their long part and run one at a time, so that the
prefix cache spares all but one of the long prefills (the tokenization of all 8 still happens at
once, on arrival)."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest
from http_testlib import request, running_server, tiny_model

from pyserve.model_files import load_tokenizer, resolve_model

PROMPT_TOKENS = 8000
REQUESTS = 8
LAG = "pyserve_event_loop_lag_seconds"
HANG_GUARD_S = 120.0  # only against a hang


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


def long_prompt(tokens: int) -> str:
    """Varied text (words and numbers), ``tokens`` tokens long."""
    tokenizer = load_tokenizer(resolve_model(None))
    words = ["river", "stone", "quiet", "lantern", "orbit", "maple", "thunder", "velvet"]
    text = " ".join(f"{words[i % len(words)]}{i * 7919 % 1000}" for i in range(tokens // 2))
    ids = tokenizer.encode(text)
    assert len(ids) > tokens, len(ids)
    return tokenizer.decode(ids[:tokens])


def lag_histogram(url: str) -> dict[str, float]:
    """Cumulative bucket counts of the loop-lag histogram, by upper bound."""
    _, _, raw = request(url + "/metrics")
    pattern = rf'^{LAG}_bucket{{le="([^"]+)"}} ([0-9.e+-]+)$'
    return {le: float(n) for le, n in re.findall(pattern, raw.decode(), re.MULTILINE)}


def test_long_prompts_are_tokenized_off_the_event_loop(model_dir):
    text = long_prompt(PROMPT_TOKENS)
    args = ["--model", str(model_dir), "--context-length", "16384", "--kv-cache-tokens", "20000"]
    args += ["--max-running-requests", "1", "--torch-threads", "1"]
    with running_server(args) as server:
        url = server.url

        async def scenario() -> tuple[list[float], list[dict]]:
            health: list[float] = []
            done = asyncio.Event()

            async def poll_health(session: aiohttp.ClientSession) -> None:
                while not done.is_set():
                    started = time.perf_counter()
                    async with session.get(url + "/health") as resp:
                        assert resp.status == 200
                    health.append(time.perf_counter() - started)
                    await asyncio.sleep(0.02)

            async def chat(session: aiohttp.ClientSession, i: int) -> dict:
                content = f"{text}\nRequest {i}: summarize."
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            guard = aiohttp.ClientTimeout(total=HANG_GUARD_S)
            async with aiohttp.ClientSession(timeout=guard) as session:
                poller = asyncio.create_task(poll_health(session))
                outputs = await asyncio.gather(*(chat(session, i) for i in range(REQUESTS)))
                done.set()
                await poller
            return health, outputs

        before = lag_histogram(url)
        health, outputs = asyncio.run(scenario())
        ended = lag_histogram(url)["+Inf"]
        after = lag_histogram(url)
        deadline = time.monotonic() + HANG_GUARD_S
        while after["+Inf"] < ended + 2:  # the probe lives on, past the scenario
            assert time.monotonic() < deadline, "the lag probe stopped"
            time.sleep(0.05)
            after = lag_histogram(url)

    assert all(o["usage"]["prompt_tokens"] > PROMPT_TOKENS for o in outputs)
    probes = after["+Inf"] - before["+Inf"]
    stalls = probes - (after["0.05"] - before["0.05"])
    assert stalls == 0, f"{stalls:.0f} of {probes:.0f} loop-lag probes were 50 ms late or more"
    assert health, "/health was never answered"  # each answer was a 200 (poll_health)
