"""Tokenization must not block the event loop: while 8 chat requests with ~8k-token prompts are
templated and tokenized, a lag probe on the server's loop stays under 50 ms and /health keeps
answering. The server runs in this process (create_app over a real Engine) so that the probe
shares its loop; the model is the tiny one, so that compute does not dominate."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import uvloop
from aiohttp import web
from http_testlib import tiny_model

from pyserve import Engine, EngineConfig, create_app
from pyserve.model_files import load_tokenizer, resolve_model

PROMPT_TOKENS = 8000
REQUESTS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


def long_prompt(tokens: int) -> str:
    """Varied text (numbers and words), about ``tokens`` tokens long."""
    tokenizer = load_tokenizer(resolve_model(None))
    words = "river stone quiet lantern orbit maple thunder velvet harbor signal".split()
    text = " ".join(f"{words[i % len(words)]}{i * 7919 % 1000}" for i in range(tokens // 2))
    ids = tokenizer.encode(text)
    assert len(ids) > tokens, len(ids)
    return tokenizer.decode(ids[:tokens])


def test_long_prompts_are_tokenized_off_the_event_loop(model_dir):
    text = long_prompt(PROMPT_TOKENS)

    async def scenario() -> tuple[list[float], list[int], list[dict]]:
        config = EngineConfig(
            model=str(model_dir),
            kv_cache_tokens=REQUESTS * (PROMPT_TOKENS + 64),
            max_model_len=16384,
            tokenizer_workers=2,
            torch_threads=1,
            log_level="warning",
        )
        engine = await Engine.start(config)
        runner = web.AppRunner(create_app(engine))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        loop = asyncio.get_running_loop()
        lags: list[float] = []
        health: list[int] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                before = loop.time()
                await asyncio.sleep(0.005)
                lags.append(loop.time() - before - 0.005)

        async def poll_health(session: aiohttp.ClientSession) -> None:
            while not done.is_set():
                async with session.get(url + "/health") as resp:
                    health.append(resp.status)
                await asyncio.sleep(0.02)

        async def chat(session: aiohttp.ClientSession, i: int) -> dict:
            body = {
                "messages": [{"role": "user", "content": f"Request {i}. {text}"}],
                "max_tokens": 1,
            }
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        try:
            async with aiohttp.ClientSession() as session:
                background = [
                    asyncio.create_task(probe()),
                    asyncio.create_task(poll_health(session)),
                ]
                await asyncio.sleep(0.1)
                started = time.perf_counter()
                outputs = await asyncio.gather(*(chat(session, i) for i in range(REQUESTS)))
                print(f"8 long requests took {time.perf_counter() - started:.2f} s")
                done.set()
                await asyncio.gather(*background)
        finally:
            await runner.cleanup()
            await engine.shutdown()
        return lags, health, outputs

    lags, health, outputs = uvloop.run(scenario())
    assert all(o["usage"]["prompt_tokens"] > PROMPT_TOKENS for o in outputs)
    assert max(lags) < 0.05, f"the event loop stalled for {max(lags) * 1000:.0f} ms"
    assert len(health) >= 5 and set(health) == {200}
