"""The real worker subprocess over ipc:// sockets, driven by the real planner (issue 3, §5).

The test plays main (PUSH NewRequest / Step / Shutdown) and the detokenizer (PULL what the worker
sends), in a private 0700 directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from worker_testlib import check_against_reference, hf_greedy, make_tiny_llama

from pyserve.wire import main_to_worker as to_worker
from pyserve.wire import worker_to_detok as from_worker
from pyserve.wire.main_to_worker import NewRequest, SamplingParams, step_from_plan
from pyserve.worker.process import WorkerConfig
from pyserve.worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
BLOCK = 4
NUM_BLOCKS = 128
RECV_TIMEOUT_MS = 60_000  # the first message waits for torch and the model to load


class Ring:
    """Our two ends of the worker's sockets, and the worker process."""

    def __init__(self, model: str, directory: str, parent_pid: int) -> None:
        self.ctx = zmq.Context()
        self.config = WorkerConfig(
            in_addr=f"ipc://{directory}/worker",
            out_addr=f"ipc://{directory}/detok",
            settings=WorkerSettings(model=model, num_blocks=NUM_BLOCKS, block_size=BLOCK),
            parent_pid=parent_pid,
            log_level="warning",
            torch_threads=1,
        )
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.config.out_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.config.in_addr)
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        config = msgspec.json.encode(self.config).decode()
        return [sys.executable, "-m", "pyserve.worker", "--config", config]

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command(), cwd=REPO)

    def send(self, msg: msgspec.Struct) -> None:
        self.push.send(to_worker.encoder.encode(msg))

    def recv(self, timeout_ms: int = RECV_TIMEOUT_MS) -> msgspec.Struct:
        if not self.pull.poll(timeout_ms):
            raise TimeoutError("no message from the worker")
        return from_worker.decoder.decode(self.pull.recv())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.ctx.term()


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="pyserve-worker-test-")  # mode 0700
    assert os.stat(directory).st_mode & 0o777 == 0o700
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def ring(tiny_model: Path) -> Iterator[Ring]:
    directory = tempfile.mkdtemp(prefix="pyserve-worker-test-")
    ring = Ring(str(tiny_model), directory, os.getpid())
    ring.start()
    try:
        ready = ring.recv()
        assert isinstance(ready, from_worker.WorkerReady), ready
        assert (ready.num_blocks, ready.block_size) == (NUM_BLOCKS, BLOCK)
        assert ready.kv_cache_bytes > 0
        yield ring
    finally:
        ring.close()
        shutil.rmtree(directory, ignore_errors=True)


def i64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def run_requests(
    ring: Ring, prompts: list[list[int]], params: SamplingParams, first_rid: int
) -> dict[int, list[int]]:
    """Sends the requests and the planner's Steps (two in flight); returns tokens per rid."""
    from pyserve._core import Planner  # the C++ core, as the main process uses it

    planner = Planner(NUM_BLOCKS, BLOCK, vocab_size=512)
    outputs: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rid = first_rid + i
        prompt_ids = np.asarray(prompt, dtype="<i4").tobytes()
        planner.add_request(rid, prompt_ids, params.max_new_tokens)
        ring.send(NewRequest(rid=rid, prompt_ids=prompt_ids, sampling=params))
        forwarded = ring.recv()
        assert isinstance(forwarded, from_worker.DetokRequest)
        assert (forwarded.rid, forwarded.prompt_ids) == (rid, prompt_ids)
        outputs[rid] = []
    unfinished = set(outputs)
    in_flight = 0
    while unfinished or in_flight:
        plan = planner.plan() if in_flight < 2 else None
        if plan is not None:
            ring.send(step_from_plan(plan))
            in_flight += 1
            continue
        result = ring.recv()
        assert isinstance(result, from_worker.StepTokens), result
        in_flight -= 1
        planner.report(result.step_id, result.rids, result.token_ids)
        rids = np.frombuffer(result.rids, dtype="<i8").tolist()
        tokens = np.frombuffer(result.token_ids, dtype="<i4").tolist()
        finishes = np.frombuffer(result.finish, dtype=np.uint8).tolist()
        for rid, token, finish in zip(rids, tokens, finishes, strict=True):
            outputs[rid].append(token)
            if finish != from_worker.FINISH_NONE:
                planner.finish(rid)
                unfinished.discard(rid)
    plan = planner.plan()  # hands the finished rids to the worker as ``dropped``
    if plan is not None:
        ring.send(step_from_plan(plan))
        assert isinstance(ring.recv(), from_worker.StepTokens)
    return outputs


def test_worker_generates_what_hf_generates(ring: Ring, tiny_model: Path) -> None:
    prompts = [[5, 9, 200, 31, 7], list(range(40, 63)), [400, 3, 3, 3, 17, 99, 250, 11, 12]]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = run_requests(ring, prompts, params, first_rid=100)
    for i, ref in enumerate(hf_greedy(tiny_model, prompts, 16)):
        check_against_reference(outputs[100 + i], ref, f"prompt {i}")


def test_a_failing_step_yields_a_worker_error_and_the_worker_keeps_serving(ring: Ring) -> None:
    bad = to_worker.Step(
        step_id=0,
        rids=i64([999]),  # never announced with a NewRequest
        start_pos=np.zeros(1, "<i4").tobytes(),
        num_tokens=np.ones(1, "<i4").tobytes(),
        is_decode=b"\x00",
        sample=b"\x01",
        input_ids=np.ones(1, "<i4").tobytes(),
        block_offsets=np.zeros(1, "<i4").tobytes(),
        block_counts=np.ones(1, "<i4").tobytes(),
        block_ids=np.zeros(1, "<i4").tobytes(),
        dropped=b"",
    )
    ring.send(bad)
    error = ring.recv()
    assert isinstance(error, from_worker.WorkerError)
    assert error.rids == i64([999]) and "999" in error.message
    empty = ring.recv()
    assert isinstance(empty, from_worker.StepTokens)
    assert (empty.step_id, empty.rids) == (0, b"")

    garbled = msgspec.structs.replace(bad, step_id=1, rids=b"\x01\x02\x03", dropped=b"\x07")
    ring.send(garbled)
    error = ring.recv()
    assert isinstance(error, from_worker.WorkerError) and error.rids == b""
    empty = ring.recv()
    assert isinstance(empty, from_worker.StepTokens) and empty.step_id == 1

    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = run_requests(ring, [[5, 6, 7]], params, first_rid=200)
    assert len(outputs[200]) == 4


def test_an_invalid_request_yields_a_worker_error_naming_it(ring: Ring) -> None:
    ring.send(
        NewRequest(rid=300, prompt_ids=b"\x05\x00\x00\x00", sampling=SamplingParams(1, top_p=0.0))
    )
    error = ring.recv()
    assert isinstance(error, from_worker.WorkerError)
    assert error.rids == i64([300]) and "top_p" in error.message
    assert isinstance(ring.recv(), from_worker.DetokRequest)  # the detokenizer still hears of it


def test_shutdown_is_forwarded_and_the_worker_exits(ring: Ring) -> None:
    # the last test of the module: the worker is gone afterwards
    ring.send(to_worker.Shutdown())
    assert isinstance(ring.recv(), from_worker.Shutdown)
    assert ring.proc.wait(timeout=10) == 0


def test_importing_the_worker_config_does_not_import_torch() -> None:
    # the main process builds a WorkerConfig and must stay light
    code = "import sys, pyserve.worker.process; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_a_load_failure_is_reported_and_exits_1(ipc_dir: str) -> None:
    ring = Ring(os.path.join(ipc_dir, "no-such-model"), ipc_dir, os.getpid())
    try:
        ring.start()
        error = ring.recv()
        assert isinstance(error, from_worker.WorkerError)
        assert "no-such-model" in error.message and "Traceback" not in error.message
        assert ring.proc.wait(timeout=30) == 1
    finally:
        ring.close()


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return True


def test_the_worker_exits_when_its_parent_dies(ipc_dir: str, tiny_model: Path) -> None:
    ring = Ring(str(tiny_model), ipc_dir, parent_pid=0)
    # a parent that starts the worker with its own pid as parent_pid, then waits forever
    launcher = (
        "import json, os, subprocess, sys, time\n"
        "cmd = json.loads(sys.argv[1])\n"
        "config = json.loads(cmd[-1]); config['parent_pid'] = os.getpid()\n"
        "child = subprocess.Popen(cmd[:-1] + [json.dumps(config)])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )

    parent = subprocess.Popen(
        [sys.executable, "-c", launcher, json.dumps(ring.command())],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker_pid = int(parent.stdout.readline())
    try:
        assert isinstance(ring.recv(), from_worker.WorkerReady)
        assert not _is_gone(worker_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60  # only against a hang
        while not _is_gone(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_gone(worker_pid), "the worker outlived its parent"
    finally:
        if not _is_gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        ring.close()
