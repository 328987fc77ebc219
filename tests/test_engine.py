"""The Engine end to end: real worker and detokenizer subprocesses over the ZMQ ring.

The model is a tiny random-weight Llama (hidden 64, 2 layers) with SmolLM2's vocabulary, so that
the real SmolLM2 tokenizer works with it. A subprocess builds it and records Hugging Face
transformers' greedy outputs, because torch must not be imported here: the main process of an
engine stays torch-free, which one test checks in a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import uvloop
from tiny_models import build_tiny_smollm

from pyserve import Engine, EngineConfig
from pyserve.engine import ContextLengthExceeded, EngineStartError, KVCacheTooSmall
from pyserve.engine.channels import RingAddresses
from pyserve.engine.requests import RequestState
from pyserve.model_files import load_tokenizer, read_model_info, resolve_model
from pyserve.wire.detok_to_main import RequestDelta
from pyserve.wire.main_to_worker import DetokParams, SamplingParams

MAX_NEW = 16
STATS_REFRESH_S = 0.25  # Engine.stats() is refreshed every 0.1 s by the scheduler thread
KV_TOKENS = 800  # 50 blocks of 16: enough for the concurrent test, less than the 1024 context
PROMPT_TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Paris is the capital of",
    "1, 2, 3, 4,",
    "The weather today is",
    "Les élèves étudient le 世界",
    "In 1969, astronauts",
]


@pytest.fixture(scope="module")
def workdir():
    # Not tmp_path_factory: pytest sessions started meanwhile may prune its older directories.
    with tempfile.TemporaryDirectory(prefix="pyserve-test-engine-") as directory:
        yield Path(directory)


@pytest.fixture(scope="module")
def tiny_model(workdir) -> Path:
    return build_tiny_smollm(
        workdir / "tiny-smollm",
        seed=0,
        max_position_embeddings=1024,
        texts=PROMPT_TEXTS,
        max_new_tokens=MAX_NEW,
    )


@pytest.fixture(scope="module")
def references(tiny_model) -> list[dict]:
    return json.loads((tiny_model / "references.json").read_text())


@pytest.fixture(scope="module")
def hf_tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def loop():
    loop = uvloop.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model, loop):
    config = EngineConfig(
        model=str(tiny_model),
        kv_cache_tokens=KV_TOKENS,
        block_size=16,
        torch_threads=1,
        tokenizer_workers=1,
        log_level="warning",
    )
    engine = loop.run_until_complete(Engine.start(config))
    yield engine
    loop.run_until_complete(engine.shutdown())


def greedy(max_new_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


async def wait_idle(engine: Engine, timeout: float = 60.0) -> dict:
    """The core's stats once nothing is queued, running or in flight."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.core_stats()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_inflight_steps"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
        await asyncio.sleep(0.02)


def assert_kv_accounting_is_idle(engine: Engine, stats: dict) -> None:
    assert stats["num_free_blocks"] + stats["cached_blocks"] == engine.num_blocks, stats
    assert stats["evictable_blocks"] == stats["cached_blocks"], "a block is still locked"


def check_against_reference(chunks: list, ref: dict, hf_tokenizer, label: str) -> None:
    tokens = [t for c in chunks for t in c.token_ids]
    for i, (ours, theirs) in enumerate(zip(tokens, ref["output"], strict=True)):
        if ours != theirs:  # allowed only where HF's top two are a near-tie
            assert ref["gaps"][i] < 1e-3, f"{label}: token {i} is {ours}, HF says {theirs}"
            break
    else:
        text = "".join(c.text for c in chunks)
        assert text == hf_tokenizer.decode(tokens, skip_special_tokens=True), label
    assert [c.completion_tokens for c in chunks] == list(range(1, len(tokens) + 1))
    assert all(c.prompt_tokens == len(ref["prompt"]) for c in chunks)
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


# ------------------------------------------------------------------------ generation


def test_greedy_streams_match_transformers_alone_and_concurrently(
    engine, loop, references, hf_tokenizer
):
    alone = loop.run_until_complete(collect(engine.generate(references[0]["prompt"], greedy())))
    check_against_reference(alone, references[0], hf_tokenizer, "alone")

    async def all_at_once():
        streams = [engine.generate(ref["prompt"], greedy()) for ref in references]
        return await asyncio.gather(*(collect(s) for s in streams))

    for i, chunks in enumerate(loop.run_until_complete(all_at_once())):
        check_against_reference(chunks, references[i], hf_tokenizer, f"concurrent #{i}")
    assert_kv_accounting_is_idle(engine, loop.run_until_complete(wait_idle(engine)))


def test_text_prompt_and_chat_go_through_the_tokenizer(engine, loop, references, hf_tokenizer):
    from_text = loop.run_until_complete(collect(engine.generate(PROMPT_TEXTS[1], greedy())))
    check_against_reference(from_text, references[1], hf_tokenizer, "text prompt")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    expected_prompt = hf_tokenizer.encode(template, add_special_tokens=False)
    assert loop.run_until_complete(engine.apply_chat_template(messages)) == expected_prompt
    chat = loop.run_until_complete(collect(engine.chat(messages, greedy())))
    plain = loop.run_until_complete(collect(engine.generate(expected_prompt, greedy())))
    assert [c.token_ids for c in chat] == [c.token_ids for c in plain]
    assert chat[-1].prompt_tokens == len(expected_prompt)


def test_stop_string_ends_the_request_without_leaking(engine, loop, references):
    prompt = references[2]["prompt"]
    full = loop.run_until_complete(collect(engine.generate(prompt, greedy())))
    text = "".join(c.text for c in full)
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    stopped = loop.run_until_complete(
        collect(engine.generate(prompt, greedy(), DetokParams(stop=[stop])))
    )
    assert "".join(c.text for c in stopped) == text[: text.find(stop)]
    assert (stopped[-1].finish_reason, stopped[-1].matched_stop) == ("stop", stop)
    assert stopped[-1].completion_tokens < MAX_NEW
    assert_kv_accounting_is_idle(engine, loop.run_until_complete(wait_idle(engine)))


def test_logprobs_come_with_every_token(engine, loop, references):
    sampling = SamplingParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    chunks = loop.run_until_complete(collect(engine.generate(references[0]["prompt"], sampling)))
    for chunk in chunks:
        assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
        for token, entry in zip(chunk.token_ids, chunk.logprobs, strict=True):
            assert entry.token_id == token and entry.logprob <= 0.0
            assert len(entry.top) == 3 and entry.top[0][0] == token  # greedy takes the best
            assert entry.top[0][1] == pytest.approx(entry.logprob, abs=1e-5)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == references[0]["output"][:6]


def test_stream_interval_coalesces_tokens_but_sends_the_first_at_once():
    async def run() -> list:
        state = RequestState("r", 1, prompt_tokens=3, stream_interval=4)
        for i in range(10):
            finish = "length" if i == 9 else None
            state.add_delta(RequestDelta(1, f"t{i}", bytes([i, 0, 0, 0]), finish), None)
        chunks = []
        while not chunks or chunks[-1].finish_reason is None:
            chunks.append(await state.next_chunk())
        return chunks

    chunks = asyncio.run(run())
    assert [c.token_ids for c in chunks] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert [c.text for c in chunks] == ["t0", "t1t2t3t4", "t5t6t7t8", "t9"]
    assert [c.completion_tokens for c in chunks] == [1, 5, 9, 10]


def test_worker_busy_time_and_token_counters_add_up(engine, loop, references):
    """The counters /metrics exports: the worker's busy seconds and steps (utilisation =
    Δbusy / Δwall) and the tokens handed to streams, read before and after known work."""
    from pyserve.http.metrics import Metrics

    async def run() -> tuple[dict, float, list]:
        await wait_idle(engine)
        started = time.perf_counter()  # the window holds every step the counters can count
        await asyncio.sleep(STATS_REFRESH_S)
        before = engine.stats()
        streams = [engine.generate(ref["prompt"], greedy()) for ref in references[:3]]
        results = await asyncio.gather(*(collect(s) for s in streams))
        await wait_idle(engine)
        await asyncio.sleep(STATS_REFRESH_S)
        return before, time.perf_counter() - started, results

    before, wall, results = loop.run_until_complete(run())
    after = engine.stats()
    tokens = sum(len(c.token_ids) for chunks in results for c in chunks)
    assert tokens == 3 * MAX_NEW
    assert after["handed_tokens"] - before["handed_tokens"] == tokens
    # every token came from a step; a step holds at most one token of each of the 3 requests
    steps = after["worker_steps"] - before["worker_steps"]
    assert MAX_NEW <= steps <= tokens + 4, steps
    busy = after["worker_busy_seconds"] - before["worker_busy_seconds"]
    assert 0 < busy <= wall, (busy, wall)

    exported = Metrics(engine).render().decode()
    for name, key in (
        ("pyserve_worker_busy_seconds_total", "worker_busy_seconds"),
        ("pyserve_worker_steps_total", "worker_steps"),
        ("pyserve_streamed_tokens_total", "handed_tokens"),
    ):
        line = next(x for x in exported.splitlines() if x.startswith(name + " "))
        assert float(line.split()[1]) == pytest.approx(after[key]), name


# ------------------------------------------------------------------------ aborts


def assert_stopped_early(stats: dict) -> None:
    """An aborted request's computed full blocks go to the cache (from empty, before the test);
    a request that ran its 400 tokens to the end would have left about 25 blocks there."""
    assert stats["cached_blocks"] * 16 <= 120, f"the aborted requests ran on: {stats}"


def test_a_closed_stream_aborts_its_request_and_returns_its_blocks(engine, loop, references):
    async def read_three_then_close():
        await engine.flush_cache()
        stream = engine.generate(references[3]["prompt"], greedy(max_new_tokens=400))
        chunks = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        return chunks

    chunks = loop.run_until_complete(read_three_then_close())
    assert len(chunks) == 3 and chunks[-1].finish_reason is None
    stats = loop.run_until_complete(wait_idle(engine))
    assert_kv_accounting_is_idle(engine, stats)
    assert_stopped_early(stats)
    assert engine.stats()["num_requests"] == 0


def test_a_cancelled_consumer_and_engine_abort_end_their_requests(engine, loop, references):
    async def scenario():
        await engine.flush_cache()
        consumed: list = []

        async def consume(rid: str) -> None:
            async for chunk in engine.generate(references[4]["prompt"], greedy(400), rid=rid):
                consumed.append(chunk)

        task = asyncio.create_task(consume("cancelled"))
        aborted = engine.generate(references[5]["prompt"], greedy(400), rid="aborted")
        first = await anext(aborted)
        while not consumed:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert engine.abort("aborted") is True
        assert engine.abort("no-such-request") is False
        rest = [chunk async for chunk in aborted]
        return first, rest

    first, rest = loop.run_until_complete(scenario())
    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort"
    stats = loop.run_until_complete(wait_idle(engine))
    assert_kv_accounting_is_idle(engine, stats)
    assert_stopped_early(stats)
    assert engine.stats()["num_requests"] == 0


# ------------------------------------------------------------------------ cache and checks


def test_prefix_cache_hits_are_reported_and_flush_releases_them(engine, loop, hf_tokenizer):
    prompt = hf_tokenizer.encode("A long shared system prompt about caching. " * 8)
    assert len(prompt) > 48
    first = loop.run_until_complete(collect(engine.generate(prompt, greedy(4))))
    second = loop.run_until_complete(collect(engine.generate(prompt, greedy(4))))
    assert first[-1].cached_tokens == 0
    whole_blocks = (len(prompt) - 1) // 16 * 16  # the last prompt token is always recomputed
    assert second[-1].cached_tokens >= whole_blocks - 16
    assert second[-1].cached_tokens > 0
    assert [c.token_ids for c in first] == [c.token_ids for c in second]

    stats = loop.run_until_complete(wait_idle(engine))
    assert stats["cached_blocks"] > 0
    released = loop.run_until_complete(engine.flush_cache())
    assert released == stats["cached_blocks"]
    after = loop.run_until_complete(engine.core_stats())
    assert after["cached_blocks"] == 0 and after["num_free_blocks"] == engine.num_blocks


def test_requests_that_cannot_run_are_refused_before_any_work(engine, loop):
    async def first_chunk(prompt, sampling, rid=None):
        return await anext(engine.generate(prompt, sampling, rid=rid))

    run = loop.run_until_complete
    with pytest.raises(ContextLengthExceeded) as info:
        run(first_chunk([5] * 1000, greedy(100)))
    assert (info.value.prompt_tokens, info.value.max_new_tokens) == (1000, 100)
    assert info.value.context_length == engine.context_length == 1024
    assert "1024" in str(info.value) and "1100" in str(info.value)
    with pytest.raises(KVCacheTooSmall):
        run(first_chunk([5] * 900, greedy(10)))  # fits the context, not the 800-token pool
    with pytest.raises(ValueError, match="empty"):
        run(first_chunk([], greedy()))
    with pytest.raises(ValueError, match="out of range"):
        run(first_chunk([5, 49152], greedy()))
    with pytest.raises(ValueError, match="max_new_tokens"):
        run(first_chunk([5], greedy(0)))
    with pytest.raises(ValueError, match="a tenant needs fairness='tenant'"):
        run(anext(engine.generate([5], greedy(), tenant="alice")))

    async def duplicate_rid():
        running = engine.generate([5, 6, 7], greedy(50), rid="same")
        await anext(running)
        try:
            await first_chunk([5, 6, 7], greedy(), rid="same")
        finally:
            await running.aclose()

    with pytest.raises(ValueError, match="already running"):
        run(duplicate_rid())
    assert_kv_accounting_is_idle(engine, run(wait_idle(engine)))


def test_tokenizer_services_and_info(engine, loop, hf_tokenizer):
    text = "Tokenize this: 世界 😀"
    ids = loop.run_until_complete(engine.tokenize(text))
    assert ids == hf_tokenizer.encode(text)
    assert loop.run_until_complete(engine.detokenize(ids)) == hf_tokenizer.decode(ids)
    assert engine.ready and engine.healthy
    assert engine.model_name == Path(engine.config.model).name
    assert engine.num_blocks == KV_TOKENS // 16
    info = engine.server_info()
    assert info["kv_cache"]["num_blocks"] == engine.num_blocks
    assert info["context_length"] == 1024
    assert info["weight_bytes"] > 0  # what a decode step reads (tests/test_weight_bytes.py)
    assert info["versions"]["pyserve"]


def test_start_fails_clearly_when_the_worker_cannot_load(tiny_model, workdir, loop):
    broken = workdir / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    engine = Engine(EngineConfig(model=str(broken), kv_cache_tokens=256, log_level="critical"))
    with pytest.raises(EngineStartError, match="could not load"):
        loop.run_until_complete(engine.start())
    assert all(child.returncode is not None for child in engine._children.items)
    assert not os.path.exists(engine._addresses.directory)


# ------------------------------------------------------------------------ process hygiene

LIGHT_MAIN = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from pyserve import Engine, EngineConfig, SamplingParams

    async def main():
        engine = await Engine.start(EngineConfig(model=sys.argv[1], kv_cache_tokens=256))
        chunks = [c async for c in engine.generate("Hello", SamplingParams(max_new_tokens=4))]
        assert chunks[-1].finish_reason is not None
        pids = [child.pid for child in engine._children.items]
        ipc = engine._addresses.directory
        ipc_while_serving = os.path.exists(ipc)
        torch_loaded = "torch" in sys.modules
        await engine.shutdown()
        print(json.dumps({
            "pids": pids, "ipc": ipc, "ipc_while_serving": ipc_while_serving, "torch": torch_loaded
        }))

    asyncio.run(main())
    """
)


def test_main_process_stays_light_and_shutdown_leaves_nothing(tiny_model):
    done = subprocess.run(
        [sys.executable, "-c", LIGHT_MAIN, str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["torch"] is False, "the main process imported torch"
    # once the ring is connected its files go, so even a SIGKILL of main leaves none behind
    assert report["ipc_while_serving"] is False
    assert not os.path.exists(report["ipc"]), "the IPC directory was left behind"
    for pid in report["pids"]:
        assert not os.path.exists(f"/proc/{pid}"), f"child {pid} outlived the engine"


def test_kv_pool_is_sized_from_the_model_and_the_budget():
    info = read_model_info(resolve_model(None))  # SmolLM2: 30 layers × 3 KV heads × 64 dims
    default = EngineConfig()
    assert default.resolved_dtype() == "float32"
    assert default.resolved_kv_cache_dtype() == "float16"  # a float32 model on the CPU
    assert default.num_kv_blocks(info) == -(-((1 << 30) // (2 * 30 * 3 * 64 * 2)) // 16)
    exact = EngineConfig(kv_cache_dtype="float32")
    assert exact.num_kv_blocks(info) == -(-((1 << 30) // (2 * 30 * 3 * 64 * 4)) // 16)
    assert EngineConfig(dtype="bfloat16").resolved_kv_cache_dtype() == "bfloat16"
    assert EngineConfig(dtype="bfloat16").num_kv_blocks(info) == -(-((1 << 30) // 23040) // 16)
    assert EngineConfig(device="cuda", dtype="float32").resolved_kv_cache_dtype() == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4").validate()
    # int8 K/V: 64 one-byte values and a float16 scale per 32 of them, scales counted
    int8 = EngineConfig(kv_cache_dtype="int8")
    assert int8.num_kv_blocks(info) == -(-((1 << 30) // (2 * 30 * 3 * (64 + 2 * 2))) // 16)
    assert int8.worker_settings(None, 1).kv_cache_dtype == "int8"
    assert EngineConfig(kv_cache_tokens=1000, block_size=32).num_kv_blocks(info) == 32
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="random").validate()
    EngineConfig(schedule_policy="priority", request_timeout=2.5).validate()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="request_timeout"):
            EngineConfig(request_timeout=bad).validate()
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8").validate()


def test_prefill_budget_defaults_by_device_and_can_be_set():
    assert EngineConfig().resolved_prefill_budget() == (512, 512)  # CPU: decodes keep flowing
    assert EngineConfig(device="cuda").resolved_prefill_budget() == (8192, 2048)
    assert EngineConfig(max_prefill_tokens=100).resolved_prefill_budget() == (100, 512)
    assert EngineConfig(chunked_prefill_size=64).resolved_prefill_budget() == (512, 64)
    EngineConfig().validate()
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=0).validate()


def test_ipc_directory_is_private():
    addresses = RingAddresses.create()
    try:
        assert os.stat(addresses.directory).st_mode & 0o777 == 0o700
        for address in (addresses.worker_in, addresses.detok_in, addresses.main_in):
            assert address.startswith(f"ipc://{addresses.directory}/")
    finally:
        addresses.remove()
    assert not os.path.exists(addresses.directory)
