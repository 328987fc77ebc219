"""The step watchdog: a worker stuck inside a step turns /health to 503 (and says why) until the
step completes; nothing is killed and no request fails.

The watch's logic runs against a fake clock; one real server stalls its worker on purpose,
through the test-only hook that holds the worker's steps while a file exists: the stall lasts
until the test lets go, however fast or slow the machine."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import time

import pytest
from http_testlib import metrics, request, running_server, tiny_model

from pyserve.cli import build_parser, engine_config
from pyserve.engine import EngineConfig
from pyserve.engine.step_watch import StepWatch
from pyserve.testing.worker_hooks import HOLD_STEPS


def records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_step_unanswered_past_the_timeout_is_a_stall_until_it_completes(caplog):
    caplog.set_level(logging.INFO, logger="pyserve.engine")
    watch = StepWatch(timeout=10.0)
    assert not watch.check(0.0) and watch.stall is None  # nothing outstanding
    watch.sent(1, 3, now=100.0)
    assert watch.oldest_age(104.0) == 4.0
    assert not watch.check(110.0)  # exactly the timeout: not yet
    assert watch.check(110.5)
    assert watch.stall is not None and watch.stall[:3] == (1, 3, 100.0)
    assert watch.stalls == 1
    [error] = records(caplog, logging.ERROR)
    assert "worker stalled: step 1 (3 request(s))" in error and "for 10.5 s" in error
    assert "step timeout 10 s" in error
    for now in (111.0, 200.0, 500.0):  # one error per stall, however long it lasts
        assert not watch.check(now) and watch.stall is not None
    assert len(records(caplog, logging.ERROR)) == 1
    assert watch.oldest_age(500.0) == 400.0

    watch.done(1, now=520.0)
    assert watch.check(520.1)
    assert watch.stall is None and watch.stalls == 1 and watch.oldest_age(521.0) == 0.0
    [info] = records(caplog, logging.INFO)
    assert info.startswith("worker recovered after 420.0 s: step 1 (3 request(s)) completed")
    assert not watch.check(600.0)


def test_a_step_queued_behind_another_is_timed_from_when_the_worker_gets_to_it():
    watch = StepWatch(timeout=10.0)
    watch.sent(1, 1, now=0.0)
    watch.sent(2, 2, now=0.1)  # overlap: queued while step 1 runs
    watch.done(1, now=8.0)
    assert watch.oldest_age(9.0) == 1.0
    assert not watch.check(17.9)  # step 2 was sent 17.8 s ago, but the worker had it for 9.9
    assert watch.check(18.1) and watch.stall is not None and watch.stall.step_id == 2
    assert watch.stall.num_requests == 2 and watch.stall.since == 8.0


def test_a_stalled_step_that_completes_into_another_stall_counts_twice(caplog):
    caplog.set_level(logging.INFO, logger="pyserve.engine")
    watch = StepWatch(timeout=1.0)
    watch.sent(7, 1, now=0.0)
    watch.sent(8, 1, now=0.0)
    assert watch.check(2.0) and watch.stall.step_id == 7
    watch.done(7, now=3.0)
    assert watch.check(3.5)  # recovered, and step 8 is not late yet
    assert watch.stall is None
    assert watch.check(4.5) and watch.stall.step_id == 8 and watch.stalls == 2
    watch.done(8, now=5.0)
    # a late StepDone that also covers an earlier id pops everything up to it
    watch.sent(9, 1, now=5.0)
    watch.sent(10, 1, now=5.0)
    watch.done(10, now=5.5)
    assert watch.check(5.6) and watch.stall is None and watch.oldest_age(9.0) == 0.0
    assert len(records(caplog, logging.ERROR)) == 2
    assert len(records(caplog, logging.INFO)) == 2


def test_timeout_zero_never_declares_a_stall_but_still_measures():
    watch = StepWatch(timeout=0.0)
    watch.sent(1, 1, now=0.0)
    assert not watch.check(1e6) and watch.stall is None and watch.stalls == 0
    assert watch.oldest_age(1e6) == 1e6


def test_step_timeout_goes_from_the_cli_into_engine_config():
    parser = build_parser()
    assert engine_config(parser.parse_args(["run"])).step_timeout == 300.0
    assert EngineConfig().step_timeout == 300.0
    assert engine_config(parser.parse_args(["run", "--step-timeout", "2.5"])).step_timeout == 2.5
    config = engine_config(parser.parse_args(["run", "--step-timeout", "0"]))
    assert config.step_timeout == 0.0
    config.validate()
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="step_timeout"):
            EngineConfig(step_timeout=bad).validate()


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)
    return result


HANG_GUARD_S = 60.0  # only against a hang: every wait below ends on what the server does
# The server's step timeout. The time checks below are the watchdog's rule, which holds on any
# machine: a stall is declared only once the held step's age has passed it, and the step is held
# (by the test) for as long as the test likes.
STEP_TIMEOUT_S = 1.0


def test_a_stalled_worker_turns_health_to_503_and_back(tmp_path_factory, tmp_path, monkeypatch):
    model = tiny_model(tmp_path_factory.getbasetemp())
    hold = tmp_path / "hold-steps"
    monkeypatch.setenv(HOLD_STEPS, str(hold))  # the server inherits it
    args = ["--model", str(model), "--dtype", "float32", "--kv-cache-tokens", "1024"]
    args += ["--torch-threads", "1", "--step-timeout", str(STEP_TIMEOUT_S)]
    with running_server(args) as server:
        url = server.url
        assert request(url + "/health")[0] == 200
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        hold.touch()  # the next step waits inside the worker until the file goes
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                submitted = time.monotonic()
                first = pool.submit(request, url + "/v1/completions", body)

                def unhealthy():
                    status, _, raw = request(url + "/health")
                    return (status, json.loads(raw)) if status != 200 else None

                status, health = wait_until(unhealthy, HANG_GUARD_S, "a 503 from /health")
                seen_unhealthy = time.monotonic()
                assert seen_unhealthy - submitted >= STEP_TIMEOUT_S  # not before the timeout
                assert not first.done()
                assert status == 503 and health["status"] == "unhealthy", health
                assert health["reason"].startswith("the worker is stalled: step "), health
                assert "(1 request(s)) has had no answer from the worker for " in health["reason"]
                stalled = metrics(url)
                assert stalled["pyserve_worker_step_stalled"] == 1
                # the age the stall was declared at, or more (the step is still held)
                assert stalled["pyserve_worker_oldest_step_age_seconds"] >= STEP_TIMEOUT_S
                assert stalled["pyserve_ready"] == 0
                # a stall is not a failure: new requests are taken and served once it clears
                second = pool.submit(request, url + "/v1/completions", body)
                released = time.monotonic()
                hold.unlink()

                for answer in (first.result(HANG_GUARD_S), second.result(HANG_GUARD_S)):
                    status, _, raw = answer
                    assert status == 200, raw
                    assert json.loads(raw)["usage"]["completion_tokens"] == 4
        finally:
            hold.unlink(missing_ok=True)

        wait_until(lambda: request(url + "/health")[0] == 200, HANG_GUARD_S, "a 200 from /health")
        recovered = wait_until(
            lambda: [line for line in server.lines if "worker recovered after" in line],
            HANG_GUARD_S,
            "the recovery line",
        )
        seen_recovered = time.monotonic()
        after = metrics(url)
        assert after["pyserve_worker_step_stalled"] == 0
        assert after["pyserve_worker_step_stalls_total"] == 1
        # no step is outstanding once every answer is in: the metric's "none" value
        assert after["pyserve_worker_oldest_step_age_seconds"] == 0
        assert after["pyserve_ready"] == 1
        [error] = [line for line in server.lines if "worker stalled: step" in line]
        assert " ERROR " in error and "(1 request(s))" in error and "step timeout 1 s" in error
        assert len(recovered) == 1 and " INFO " in recovered[0]
        # The stalled step was the worker's from before the 503 (by at least the step timeout)
        # until after the release, and it was sent after the request was: the stall the server
        # reports lies between those two spans (its log rounds to 0.1 s).
        took = float(recovered[0].split("worker recovered after ")[1].split(" s")[0])
        lower = STEP_TIMEOUT_S + (released - seen_unhealthy) - 0.05
        assert lower <= took <= seen_recovered - submitted + 0.05


@pytest.mark.parametrize(
    "failure, status_code, words",
    [
        (None, "draining", "shutting down"),
        (RuntimeError("worker died"), "engine_dead", "worker died"),
    ],
)
def test_requests_to_a_closing_or_failed_engine_get_503_saying_which(failure, status_code, words):
    """An engine that is not serving is either closing (an embedding app stops it; no failure)
    or dead: the 503 says which, never "The engine has failed: None"."""
    from types import SimpleNamespace

    from pyserve.http.errors import APIError
    from pyserve.http.state import ServerState

    state = ServerState.__new__(ServerState)  # check_serving reads only these two
    state.draining = False
    state.engine = SimpleNamespace(ready=True, serving=False, failure=failure)
    with pytest.raises(APIError) as raised:
        state.check_serving()
    assert raised.value.status == 503 and raised.value.info.code == status_code
    assert words in raised.value.info.message and "None" not in raised.value.info.message
