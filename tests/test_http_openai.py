"""The OpenAI API through real HTTP: the official SDK (sync and async), the SSE wire format byte
by byte, concurrency, and clients that disconnect. One `pyserve run` server for the module, on
a tiny random-weight model with SmolLM2's tokenizer (float32, so greedy outputs are exact)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from http_testlib import (
    kv_idle,
    metrics,
    references,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from pyserve.model_files import load_tokenizer, resolve_model

MODEL = "http-tiny-model"  # the model directory's name
KV_TOKENS = 16384
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def refs(model_dir):
    return references(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    # the exact mode: float32 compute and K/V (auto would store K/V in float16 on the CPU)
    args = ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-dtype", "float32"]
    args += ["--kv-cache-tokens", str(KV_TOKENS)]
    args += ["--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- the SDK


def test_sdk_chat_stream_equals_non_stream_and_usage_is_counted(client, tokenizer):
    messages = [{"role": "user", "content": "Tell me a story about a dragon."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, messages))
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens == full.usage.prompt_tokens
    # the same prompt again: its full blocks come from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens >= 16


def test_sdk_completions_match_transformers(client, refs, tokenizer):
    for ref in refs[:2]:
        out = client.completions.create(
            model=MODEL, prompt=ref["prompt"], max_tokens=len(ref["output"]), logprobs=1, **GREEDY
        )
        choice = out.choices[0]
        assert out.usage.prompt_tokens == len(ref["prompt"])
        assert "".join(choice.logprobs.tokens) == choice.text
        offsets = choice.logprobs.text_offset
        assert offsets[0] == 0 and offsets == sorted(offsets)
        expected = [tokenizer.decode([t]) for t in ref["output"]]
        assert len(choice.logprobs.tokens) == len(expected)
        pairs = zip(choice.logprobs.tokens, expected, choice.logprobs.token_logprobs, strict=True)
        for k, (ours, theirs, logprob) in enumerate(pairs):
            if ours != theirs:  # allowed only where HF's top two were a near-tie
                assert ref["gaps"][k] < 1e-3, f"token {k}: {ours!r}, HF says {theirs!r}"
                break
            assert abs(logprob - ref["logprobs"][k]) < 2e-3
        else:
            assert choice.text == tokenizer.decode(ref["output"], skip_special_tokens=True)


def test_sdk_chat_logprobs_in_the_openai_shape(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the best
        assert abs(entry.logprob - values[0]) < 1e-6
        assert bytes(entry.bytes) == entry.token.encode()
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_sdk_stop_strings_end_the_text_before_the_stop(client):
    prompt = "Once upon a time"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    text = plain.choices[0].text
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    expected = text[: text.find(stop)]
    stopped = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stop=[stop, "\x00never"], **GREEDY
    )
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stop=stop, stream=True, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sdk_async_streams_n2_with_seeds(server):
    """Choice i of a seeded request samples with seed + i: it equals a lone request so seeded."""

    async def texts(client: AsyncOpenAI, n: int, seed: int) -> list[str]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say something random."}],
            max_tokens=10,
            temperature=5.0,  # the tiny model's logits are peaked; flatten them
            seed=seed,
            n=n,
            stream=True,
        )
        out = [""] * n
        roles = set()
        async for chunk in stream:
            for choice in chunk.choices:
                out[choice.index] += choice.delta.content or ""
                if choice.delta.role:
                    roles.add(choice.index)
        assert roles == set(range(n))  # every choice opens with the assistant role
        return out

    async def scenario():
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            pair, again, first, second = await asyncio.gather(
                texts(client, 2, 7), texts(client, 2, 7), texts(client, 1, 7), texts(client, 1, 8)
            )
            assert pair == again  # seeded sampling is reproducible, even concurrently
            assert pair == first + second
            assert pair[0] != pair[1]

    asyncio.run(scenario())


def test_sdk_errors_raise_the_matching_exceptions(client):
    with pytest.raises(BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=KV_TOKENS * 4)
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert "16384" in too_long.value.message and str(KV_TOKENS * 4) in too_long.value.message


# ----------------------------------------------------------------------------- raw SSE


def parse_sse(raw: bytes) -> list[dict]:
    """Every event is exactly b"data: <one-line JSON>\\n\\n"; the last is data: [DONE]."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = []
    for event in events[:-2]:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        payloads.append(json.loads(event[len(b"data: ") :]))
    return payloads


async def post_raw(url: str, body: dict) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp, await resp.read()


def test_chat_sse_wire_format(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 5,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp, raw = asyncio.run(post_raw(server.url + "/v1/chat/completions", body))
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(raw)
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events)
    assert all("usage" in e for e in events)  # null in every chunk but the last
    *chunks, last = events
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 10 and last["usage"]["total_tokens"] > 10
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in chunks)
    texts = []
    for index in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert all(set(c["delta"]) == {"content"} for c in mine[1:-1])
        texts.append("".join(c["delta"]["content"] for c in mine[1:-1]))

    body.update(stream=False, stream_options=None)
    _, raw = asyncio.run(post_raw(server.url + "/v1/chat/completions", body))
    full = json.loads(raw)
    assert [c["message"]["content"] for c in full["choices"]] == texts


def test_completion_sse_echo_and_no_usage_unless_asked(server):
    body = {"model": MODEL, "prompt": "Roses are red", "max_tokens": 4, "echo": True}
    body.update(stream=True, temperature=0)
    _, raw = asyncio.run(post_raw(server.url + "/v1/completions", body))
    events = parse_sse(raw)
    assert all("usage" not in e and e["object"] == "text_completion" for e in events)
    choices = [e["choices"][0] for e in events]
    assert choices[0]["text"] == "Roses are red"  # the echo comes first
    assert choices[-1] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    streamed = "".join(c["text"] for c in choices)
    body["stream"] = False
    _, raw = asyncio.run(post_raw(server.url + "/v1/completions", body))
    assert json.loads(raw)["choices"][0]["text"] == streamed


# ----------------------------------------------------------------------------- concurrency


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    tokens, tops, text = [], [], ""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    for event in parse_sse(raw):
        choice = event["choices"][0]
        text += choice["text"]
        if choice["logprobs"]:
            tokens += choice["logprobs"]["tokens"]
            tops += choice["logprobs"]["top_logprobs"]
    return {"tokens": tokens, "tops": tops, "text": text}


def test_32_concurrent_greedy_streams_equal_each_request_alone(server):
    seeds = ["The quick brown fox", "Once upon a time", "def main():", "In the year 3000"]
    bodies = [
        {
            "model": MODEL,
            "prompt": f"Story {i}. {seeds[i % 4]}",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,
            "stream": True,
        }
        for i in range(32)
    ]
    url = server.url + "/v1/completions"

    async def scenario():
        async with aiohttp.ClientSession() as session:
            alone = [await stream_completion(session, url, b) for b in bodies]
            together = await asyncio.gather(*(stream_completion(session, url, b) for b in bodies))
        return alone, together

    alone, together = asyncio.run(scenario())
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert len(a["tokens"]) == len(t["tokens"]) == 16
        for k, (x, y) in enumerate(zip(a["tokens"], t["tokens"], strict=True)):
            if x != y:  # allowed only where the lone run's top two were a near-tie
                best = sorted(a["tops"][k].values(), reverse=True)
                assert len(best) >= 2 and best[0] - best[1] < 1e-3, (
                    f"request {i} diverges at token {k}: {x!r} alone, {y!r} concurrently"
                )
                break
        else:
            assert a["text"] == t["text"]


# ----------------------------------------------------------------------------- disconnects


def test_clients_that_disconnect_are_aborted_and_their_blocks_come_back(server):
    """A stream closed after two events, and a non-streaming request whose client gives up:
    both would run for 15000 tokens; both are aborted (the server generated far fewer) and
    their blocks come back."""
    long = {"model": MODEL, "prompt": "Count:", "max_tokens": 15000, "ignore_eos": True}

    async def stream_then_close():
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.url + "/v1/completions", json={**long, "stream": True})
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            resp.close()

    async def post_then_give_up():
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(session.post(server.url + "/v1/completions", json=long))
            await asyncio.to_thread(
                wait_for_metrics, server.url, lambda m: m["pyserve_requests_running"]
            )
            task.cancel()

    for scenario in (stream_then_close, post_then_give_up):
        generated = metrics(server.url)["pyserve_generation_tokens_total"]
        asyncio.run(scenario())
        after = wait_for_metrics(server.url, kv_idle)
        ran = after["pyserve_generation_tokens_total"] - generated
        assert ran < long["max_tokens"] // 2, f"{scenario.__name__}: ran on for {ran:.0f} tokens"


def test_a_priority_is_refused_without_the_priority_policy(server):
    """Not accepted and ignored: a nonzero priority needs --schedule-policy priority."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/chat/completions", chat), ("/generate", {"text": "hi"})):
        status, _, text = request(server.url + path, dict(body, priority=1))
        assert status == 400, text
        error = json.loads(text)["error"]
        assert error["param"] == "priority" and "--schedule-policy priority" in error["message"]
        status, _, text = request(server.url + path, dict(body, priority=0))
        assert status == 200, text
