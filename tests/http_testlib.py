"""Helpers for the HTTP tests: a tiny random-weight model and a real `pyserve run` server.

The model is a 2-layer Llama (hidden 64) with SmolLM2's vocabulary and tokenizer, so that chat
templates and text prompts work, built in a subprocess (torch stays out of the test process,
as it stays out of the server's main process). Its long context (16k positions) serves the
tokenization-lag test. The builder also records Hugging Face greedy outputs for a few prompts,
with the top-2 logprob gap at every position, to tell real bugs from near-ties.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tiny_models import build_tiny_smollm

from pyserve.engine.state_dir import STATE_DIR_ENV

REFERENCE_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Les élèves étudient le 世界",
]
REFERENCE_NEW_TOKENS = 12


def tiny_model(base: Path) -> Path:
    """The tiny model under ``base`` (built once per test session, then reused)."""
    directory = base / "http-tiny-model"
    if (directory / "references.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    # Its long context (16k positions) serves the tokenization-lag test.
    return build_tiny_smollm(
        directory,
        seed=1234,
        max_position_embeddings=16384,
        texts=REFERENCE_PROMPTS,
        max_new_tokens=REFERENCE_NEW_TOKENS,
    )


def references(model_dir: Path) -> list[dict]:
    return json.loads((model_dir / "references.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, rank_args: list[list[str]], timeout: float) -> None:
    """``python -c script *args`` for each rank's args, all at once (the ranks of one
    torch.distributed group); asserts that every rank exits 0, and leaves none running."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args], env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        for args in rank_args
    ]
    try:
        assert [proc.wait(timeout) for proc in procs] == [0] * len(procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


_READY = re.compile(r"pyserve is ready at (http://\S+)")
_LISTENING = re.compile(r"\((http://\S+)/health answers 503")


class Server:
    """A `pyserve run` subprocess; its log is kept in ``lines`` (read by a thread).

    The constructor returns once the model is loaded, or with ``wait_ready=False`` as soon as
    the HTTP server listens (``url`` is then known and ``wait_ready()`` waits for the rest).

    Unless the test names one (``--state-dir`` or PYSERVE_STATE_DIR in ``env``), each server
    keeps its disk cache in a directory of its own, removed when it stops: no server finds
    another's cached prefixes (a test counting cached tokens would see them).
    """

    def __init__(
        self, args: list[str], wait_ready: bool = True, env: dict[str, str] | None = None
    ) -> None:
        self.args = args
        self.state_dir: str | None = None
        if "--state-dir" not in args and STATE_DIR_ENV not in (env or {}):
            self.state_dir = tempfile.mkdtemp(prefix="pyserve-state-")
            env = {**(env or {}), STATE_DIR_ENV: self.state_dir}
        self.lines: list[str] = []
        self.url = ""
        self._listening = threading.Event()
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyserve", "run", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait(self._listening)
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        self._wait(self._ready)

    def _wait(self, event: threading.Event, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not event.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start:\n" + self.log())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if match := _LISTENING.search(line):
                self.url = match.group(1)
                self._listening.set()
            if _READY.search(line):
                self._ready.set()

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signals the server and returns its exit code (killing it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return self.proc.returncode


@contextlib.contextmanager
def running_server(args: list[str], env: dict[str, str] | None = None) -> Iterator[Server]:
    server = Server(args, env=env)
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0, f"the server exited with {code}:\n{server.log()}"


@contextlib.contextmanager
def held_tiny_server(base: Path, hold: Path, *args: str) -> Iterator[Server]:
    """A tiny float32 model's server (one torch thread, one tokenizer worker) whose worker holds
    each step while the file ``hold`` exists, so that a test can build a queue behind it."""
    from pyserve.testing.worker_hooks import HOLD_STEPS

    argv = ["--model", str(tiny_model(base)), "--dtype", "float32", *args]
    argv += ["--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(argv, env={HOLD_STEPS: str(hold)}) as server:
        yield server


def openai_client(server: Server):
    """The official SDK's client for ``server``, without retries (a test sees every error)."""
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def child_pids(pid: int) -> list[int]:
    """The direct children of process ``pid`` (Linux)."""
    found = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(p) for p in path.read_text().split()]
    return found


SERVER_CHILD_ROLES = {"pyserve.worker": "worker", "pyserve.detokenizer": "detokenizer"}


def server_processes(main_pid: int) -> dict[str, int]:
    """role → pid for a `pyserve run` process (main) and its worker and detokenizer."""
    found = {"main": main_pid}
    for pid in child_pids(main_pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for module, role in SERVER_CHILD_ROLES.items():
                if module.encode() in argv:
                    found[role] = pid
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead


def check_against_reference(ids: list[int], ref: dict, label: str) -> int:
    """Asserts ``ids`` equal HF's greedy tokens, or diverge only where HF's top two are a
    near-tie (logprob gap < 1e-3); returns how many leading tokens are equal."""
    for i, (ours, theirs) in enumerate(zip(ids, ref["output"], strict=False)):
        if ours != theirs:
            assert ref["gaps"][i] < 1e-3, (
                f"{label}: token {i} is {ours}, HF says {theirs} (top-2 gap {ref['gaps'][i]:.3g})"
            )
            return i
    assert len(ids) == len(ref["output"]), (
        f"{label}: {len(ids)} tokens, HF made {len(ref['output'])}"
    )
    return len(ids)


def request(
    url: str, body: object = None, *, method: str | None = None, headers: dict | None = None
) -> tuple[int, dict, bytes]:
    """One plain HTTP request: (status, headers, body). ``body`` is JSON-encoded unless bytes."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def generate(url: str, ids: list[int], return_logprob: bool = False) -> dict:
    """/generate of REFERENCE_NEW_TOKENS greedy tokens after the prompt ``ids``; 200 asserted."""
    body = {
        "input_ids": ids,
        "return_logprob": return_logprob,
        "sampling_params": {
            "max_new_tokens": REFERENCE_NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    status, _, raw = request(url + "/generate", body)
    assert status == 200, raw
    return json.loads(raw)


def metrics(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    _, _, text = request(base_url + "/metrics", headers=headers)
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(pyserve_[a-z0-9_]+) ([0-9.e+-]+)$", text.decode(), re.MULTILINE)
    }


# Waits on a server's state carry this only against a hang: a verdict never depends on how soon
# the state came (the suite runs on quiet machines and busy ones alike).
HANG_GUARD_S = 60.0


def wait_for_metrics(
    base_url: str, condition, timeout: float = HANG_GUARD_S, headers: dict | None = None
) -> dict[str, float]:
    """/metrics once ``condition`` holds for it (polled); fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(base_url, headers)
        if condition(values):
            return values
        assert time.monotonic() < deadline, f"condition not met within {timeout} s: {values}"
        time.sleep(0.05)


def kv_idle(m: dict[str, float]) -> bool:
    """Nothing running or waiting, and every KV block free or held by the prefix cache."""
    no_requests = m["pyserve_requests_running"] == 0 and m["pyserve_requests_waiting"] == 0
    accounted = m["pyserve_kv_blocks_free"] + m["pyserve_kv_blocks_cached"]
    return no_requests and accounted == m["pyserve_kv_blocks_total"]


GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/responses",
    "/v1/messages",
)


def short_generation_body(base_url: str, path: str) -> dict:
    """A request of a few tokens on one of the generation endpoints (every dialect)."""
    messages = [{"role": "user", "content": "hi"}]
    if path == "/generate":
        return {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    if path == "/v1/responses":
        return {"input": "hi", "max_output_tokens": 16}
    if path == "/v1/completions":
        return {"prompt": "hi", "max_tokens": 2}
    if path == "/v1/messages":  # Anthropic's Messages requires the model
        model = json.loads(request(base_url + "/v1/models")[2])["data"][0]["id"]
        return {"messages": messages, "max_tokens": 2, "model": model}
    return {"messages": messages, "max_tokens": 2}
