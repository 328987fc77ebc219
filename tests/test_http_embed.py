"""The README's embedding example, `examples/embed_aiohttp.py`: an aiohttp application of its
own that mounts pyserve under /llm, run as its author would run it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_testlib import free_port, request, tiny_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "embed_aiohttp.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


def test_pyserve_mounted_under_llm_in_another_aiohttp_app(model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                status, _, _ = request(url + "/")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "example did not start"
                time.sleep(0.2)
        assert status == 200  # the application's own route

        body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5}
        status, _, raw = request(url + "/llm/v1/chat/completions", body)
        assert status == 200, raw
        answer = json.loads(raw)
        assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["message"]
        assert request(url + "/llm/health")[0] == 200
        status, _, raw = request(url + "/llm/no/such/route")
        assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
        status, _, raw = request(url + "/llm/v1/chat/completions", b"{")
        assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json"
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output.decode()
