"""The routes behind the web pages, in process and without a model: the static files and their
headers, the pages' place in the auth and start-up rules, and /stats' per-second samples.
The pages themselves, in a browser, are tests/test_web_ui.py's."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pyserve.cli import build_parser
from pyserve.http.app import create_app, server_state
from pyserve.http.live_stats import HISTORY, LiveStats, quantile


class FakeEngine:
    """Just enough engine for the routes that do not generate."""

    model_name = "fake"
    ready = healthy = serving = True
    failure = None

    def __init__(self) -> None:
        self.numbers: dict = {"num_blocks": 100, "num_free_blocks": 100, "block_size": 16}

    def stats(self) -> dict:
        return dict(self.numbers)


def run(coroutine):
    return asyncio.run(coroutine)


async def get_all(app: web.Application, paths: list[str], headers: dict | None = None):
    async with TestClient(TestServer(app)) as client:
        answers = []
        for path in paths:
            response = await client.get(path, headers=headers, allow_redirects=False)
            answers.append((response.status, response.headers.copy(), await response.read()))
        return answers


# ------------------------------------------------------------------ quantiles and samples


def test_quantiles_interpolate_inside_their_bucket():
    bounds = (1.0, 2.0, 4.0)
    assert quantile(bounds, [0, 2, 2, 0], 0.5) == 2.0
    assert quantile(bounds, [0, 2, 2, 0], 0.25) == 1.5
    assert quantile(bounds, [4, 0, 0, 0], 0.5) == 0.5  # the first bucket starts at zero
    assert quantile(bounds, [0, 0, 0, 5], 0.99) == 4.0  # above every bound: the last bound
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None


def test_samples_are_rates_and_trailing_percentiles_of_the_counters():
    engine = FakeEngine()
    state = server_state(create_app(engine))
    live = LiveStats(state)
    assert live.sample(100.0) is None  # a rate needs two readings

    engine.numbers.update(
        handed_tokens=120, worker_steps=30, num_running=4, num_waiting=2, num_free_blocks=70,
        cached_blocks=10, hit_tokens=30, query_tokens=40,
    )  # fmt: skip
    for seconds in (0.05, 0.05, 0.2, 0.3):
        state.metrics.ttft.observe(seconds)
    sample = live.sample(102.0)
    assert sample["output_tokens_per_s"] == 60.0 and sample["steps_per_s"] == 15.0
    assert sample["step_batch_size"] == 4.0
    assert (sample["running"], sample["waiting"]) == (4, 2)
    used, cached, free = (sample[f"kv_blocks_{k}"] for k in ("used", "cached", "free"))
    assert (used, cached, free) == (20, 10, 70)
    assert sample["prefix_cache_hit_rate"] == 0.75
    assert 0.04 < sample["ttft_s"]["p50"] <= 0.06 < sample["ttft_s"]["p99"] <= 0.5
    assert sample["itl_s"] is None  # nothing observed

    quiet = live.sample(103.0)  # no new tokens; the percentiles still cover the trailing window
    assert quiet["output_tokens_per_s"] == 0.0 and quiet["step_batch_size"] is None
    assert quiet["ttft_s"] == sample["ttft_s"] and quiet["prefix_cache_hit_rate"] == 0.75

    for t in range(HISTORY + 5):
        live.sample(104.0 + t)
    assert len(live.samples) == HISTORY
    doc = live.document(since=live.samples[-3]["t"])
    assert [s["t"] for s in doc["samples"]] == [s["t"] for s in list(live.samples)[-2:]]
    assert doc["kv_blocks_total"] == 100 and doc["totals"]["prefix_cache_hit_rate"] == 0.75


def test_the_sampler_runs_with_the_app():
    async def scenario():
        app = create_app(FakeEngine())
        async with TestClient(TestServer(app)) as client:
            await asyncio.sleep(1.3)  # two readings: one sample (this only guards a hang)
            for _ in range(100):
                doc = await (await client.get("/stats")).json()
                if doc["samples"]:
                    return doc
                await asyncio.sleep(0.1)
        raise AssertionError("no sample came")

    doc = run(scenario())
    assert doc["model"] == "fake" and doc["interval_s"] == 1.0
    assert doc["samples"][0]["running"] == 0


# ------------------------------------------------------------------ routes and headers


def test_pages_carry_csp_and_revalidate_with_their_etag():
    app = create_app(FakeEngine())
    (page, dashboard, script, style, missing) = run(
        get_all(app, ["/", "/dashboard", "/static/chat.js", "/static/style.css", "/static/x.js"])
    )
    for status, headers, _ in (page, dashboard, script, style):
        assert status == 200
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        assert "connect-src 'self'" in headers["Content-Security-Policy"]
        assert headers["Cache-Control"] == "no-cache" and headers["ETag"].startswith('"')
    assert page[1]["Content-Type"] == "text/html; charset=utf-8"
    assert script[1]["Content-Type"] == "text/javascript; charset=utf-8"
    assert style[1]["Content-Type"] == "text/css; charset=utf-8"
    assert missing[0] == 404

    etag = script[1]["ETag"]
    (again,) = run(get_all(create_app(FakeEngine()), ["/static/chat.js"], {"If-None-Match": etag}))
    assert again[0] == 304 and again[2] == b""


def test_pages_need_no_key_but_the_api_behind_them_does():
    app = create_app(FakeEngine(), api_key="secret")
    statuses = [a[0] for a in run(get_all(app, ["/", "/dashboard", "/static/chat.js", "/stats"]))]
    assert statuses == [200, 200, 200, 401]
    app = create_app(FakeEngine(), api_key="secret")
    (stats,) = run(get_all(app, ["/stats"], {"Authorization": "Bearer secret"}))
    assert stats[0] == 200 and stats[1]["Cache-Control"] == "no-store"


def test_pages_answer_while_the_model_loads():
    engine = FakeEngine()
    engine.ready = False
    statuses = [a[0] for a in run(get_all(create_app(engine), ["/", "/dashboard", "/stats"]))]
    assert statuses == [200, 200, 200]


def test_under_a_prefix_the_bare_prefix_gets_its_slash():
    parent = web.Application()
    parent.add_subapp("/llm", create_app(FakeEngine()))
    bare, page, script = run(get_all(parent, ["/llm?x=1", "/llm/", "/llm/static/chat.js"]))
    assert bare[0] == 308 and bare[1]["Location"] == "/llm/?x=1"
    assert page[0] == 200 and b'src="static/chat.js"' in page[2]
    assert script[0] == 200


def test_no_web_ui_turns_the_pages_off():
    assert build_parser().parse_args(["run", "--no-web-ui"]).web_ui is False
    assert build_parser().parse_args(["run"]).web_ui is True
    app = create_app(FakeEngine(), web_ui=False)
    statuses = [a[0] for a in run(get_all(app, ["/", "/dashboard", "/static/chat.js", "/stats"]))]
    assert statuses == [404, 404, 404, 200]
    assert server_state(app).options.web_ui is False
