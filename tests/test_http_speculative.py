"""Speculative decoding through a real `pyserve run --speculative-algorithm ngram` on the bundled
default model (its greedy text repeats its prompt and itself, so drafts are accepted): output
equal to plain decoding in process (but at its own near-ties) while drafts are verified and
accepted, stop strings and max_tokens inside an accepted run, logprobs of each emitted token's
own position, /metrics, /server_info and meta_info, and a pool left whole after a storm of
aborted speculating streams. Every family's verify entries against HF: test_model_families.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from http_testlib import kv_idle, metrics, request, running_server, wait_for_metrics

from pyserve.wire.main_to_worker import SamplingParams

NEW_TOKENS = 64
PROMPTS = [
    "def area(w, h):\n    return w * h\n\ndef volume(w, h, d):\n    return area(w, h) * d\n\n"
    "Rewrite the two functions above with type hints, and return the code whole.",
    "Repeat this list exactly, then add one more item: apples, pears, plums, cherries, figs.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def server():
    args = ["--speculative-algorithm", "ngram", "--kv-cache-tokens", "4096"]
    with running_server([*args, "--torch-threads", "2"]) as server:
        yield server


@pytest.fixture(scope="module")
def plain(server):
    """Plain decoding of PROMPTS (the server's prompt ids), in process, with the server's model
    settings: token ids, and the top-2 logprob gap at each token."""
    from pyserve.worker.offline import OfflineEngine

    ids = [tokenize(server.url, p) for p in PROMPTS]
    engine = OfflineEngine(None, quantization="auto", kv_cache_dtype="float16", num_blocks=256)
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    outputs = engine.generate(ids, params)
    return [(o.token_ids, [tops[0][1] - tops[1][1] for tops in o.top_logprobs]) for o in outputs]


def tokenize(url: str, text: str) -> list[int]:
    status, _, body = request(url + "/tokenize", {"prompt": text})
    assert status == 200, body
    return json.loads(body)["tokens"]


def generate(url: str, text: str, **sampling) -> dict:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **sampling}
    body = {"text": text, "sampling_params": params}
    status, _, raw = request(url + "/generate", body)
    assert status == 200, raw
    return json.loads(raw)


def test_greedy_output_equals_plain_decoding_while_drafts_are_accepted(server, plain):
    before = metrics(server.url)
    for prompt, (want, gaps) in zip(PROMPTS, plain, strict=True):
        out = generate(server.url, prompt)
        got = out["output_ids"]
        for i, (mine, theirs) in enumerate(zip(got, want, strict=True)):
            if mine != theirs:  # only where plain decoding's own top two were a near-tie
                assert gaps[i] < 1e-3, f"{prompt!r}: token {i} is {mine}, plainly {theirs}"
                break
        assert 0 <= out["meta_info"]["spec_accepted_tokens"] < NEW_TOKENS
    after = metrics(server.url)
    drafted = after["pyserve_spec_draft_tokens_total"] - before["pyserve_spec_draft_tokens_total"]
    accepted = (
        after["pyserve_spec_accepted_tokens_total"] - before["pyserve_spec_accepted_tokens_total"]
    )
    assert 0 < accepted <= drafted  # verify entries ran, and some drafts were kept
    # entries ran behind unreported verify passes, and some as plain decodes (drafts rejected)
    chained = [
        after[f"pyserve_spec_chained_{what}_total"] - before[f"pyserve_spec_chained_{what}_total"]
        for what in ("entries", "fallbacks")
    ]
    assert 0 < chained[1] < chained[0]
    info = json.loads(request(server.url + "/server_info")[2])["speculative"]
    assert info["algorithm"] == "ngram" and info["num_draft_tokens"] == 8
    assert info["accepted_tokens"] >= accepted


def test_stops_and_max_tokens_inside_an_accepted_run_cut_the_output_where_plain_decoding_would(
    server,
):
    prompt = PROMPTS[0]
    whole = generate(server.url, prompt)
    text, ids = whole["text"], whole["output_ids"]
    # a stop string that first completes somewhere in the middle of the output
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    cut = generate(server.url, prompt, stop=[stop])
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert ids[: len(cut["output_ids"])] == cut["output_ids"]
    # a stop token, and max_new_tokens that ends in the middle of a run of drafts
    token = ids[NEW_TOKENS // 2]
    first = ids.index(token)
    by_token = generate(server.url, prompt, stop_token_ids=[token])
    assert by_token["output_ids"] == ids[: first + 1]
    for n in (1, 5, 13):
        short = generate(server.url, prompt, max_new_tokens=n)
        assert short["output_ids"] == ids[:n]


def test_each_emitted_token_carries_the_logprobs_of_its_own_position(server):
    status, _, raw = request(
        server.url + "/generate",
        {
            "text": PROMPTS[1],
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    )
    assert status == 200, raw
    meta = json.loads(raw)["meta_info"]
    assert meta["spec_accepted_tokens"] > 0
    logprobs, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(logprobs) == len(tops) == NEW_TOKENS
    for (value, token, _), top in zip(logprobs, tops, strict=True):
        # greedy: each token is its position's most likely one (a row shifted by one position
        # would pair it with another position's distribution)
        best_value, best_token, _ = max(top)
        assert abs(value - best_value) < 1e-5
        assert token == best_token or abs(value - best_value) < 1e-5


def test_a_storm_of_aborted_speculating_streams_leaves_the_pool_whole(server):
    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {
            "text": PROMPTS[i % 3],
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        async with session.post(server.url + "/generate", json=body) as resp:
            assert resp.status == 200
            seen = 0
            async for _ in resp.content:
                seen += 1
                if seen > 3 + i % 7:
                    return  # the client goes away mid-stream

    async def storm() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(one(session, i) for i in range(24)))

    asyncio.run(storm())
    idle = wait_for_metrics(server.url, kv_idle)
    assert idle["pyserve_spec_verify_entries_total"] > 0
    assert "idle accounting check failed" not in server.log()
