"""The server's idle self-check, seen from outside: it stays silent in normal runs (see
test_http_disconnect_storm), and logs an error naming what is off when the KV accounting is
broken on purpose, through the test-only hook that takes a block out of the pool."""

from __future__ import annotations

import re

from http_testlib import request, running_server, tiny_model, wait_for_metrics

from pyserve.testing.engine_hooks import TEST_HOOK_LEAK_KV_BLOCKS


def test_the_idle_check_logs_an_error_when_a_kv_block_goes_missing(tmp_path_factory, monkeypatch):
    model = tiny_model(tmp_path_factory.getbasetemp())
    monkeypatch.setenv(TEST_HOOK_LEAK_KV_BLOCKS, "1")  # the server inherits it
    args = ["--model", str(model), "--dtype", "float32", "--kv-cache-tokens", "1024"]
    with running_server([*args, "--torch-threads", "1"]) as server:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        status, _, _ = request(server.url + "/v1/completions", body)
        assert status == 200  # the server still serves; it says what is wrong
        after = wait_for_metrics(server.url, lambda m: m["pyserve_idle_checks_total"] >= 1)
        assert after["pyserve_idle_check_failures_total"] == 1
        # 64 blocks: one is neither free nor cached, and the core's invariants say whose it is not
        line = next(line for line in server.lines if "idle accounting check failed" in line)
        assert " ERROR " in line
        free, cached = map(int, re.search(r"(\d+) free \+ (\d+) cached != 64", line).groups())
        assert free + cached == 63
        assert "core invariant broken: " in line and "block" in line
