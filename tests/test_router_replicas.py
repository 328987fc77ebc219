"""Replicas behind SGLang's model gateway (sglang-router, the test extra), as a user runs them:
two `pyserve run` servers of the tiny model behind `python -m sglang_router.launch_router`, and
`pyserve run --dp 2`, which starts both and the router itself.

On a shared-prefix load the cache-aware policy sends every prompt of a group to the replica that
already holds the group's prefix; round robin alternates replicas, so each group's prefix is
computed on both. Requests go one at a time, so the verdict counts prompt tokens served from the
replicas' prefix caches (each response's usage) and never depends on timing.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from http_testlib import (
    HANG_GUARD_S,
    Server,
    alive,
    child_pids,
    free_port,
    kv_idle,
    request,
    tiny_model,
    wait_for_metrics,
)

from pyserve import cli, replicas

MODEL = "http-tiny-model"
KV_TOKENS = 8192
GROUPS = 4
PER_GROUP = 4
PREFIX_WORDS = 160  # ~180 tokens of SmolLM2's vocabulary
REPLICA_ARGS = ["--kv-cache-tokens", str(KV_TOKENS), "--torch-threads", "1"]
REPLICA_ARGS += ["--tokenizer-workers", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def two_replicas(model_dir):
    servers = [Server(["--model", str(model_dir), *REPLICA_ARGS], wait_ready=False)]
    servers.append(Server(["--model", str(model_dir), *REPLICA_ARGS], wait_ready=False))
    try:
        for server in servers:  # both load at once
            server.wait_ready()
        yield servers
    finally:
        codes = [s.stop() for s in servers]
    assert codes == [0, 0], "\n".join(s.log() for s in servers)


class Router:
    """`python -m sglang_router.launch_router` over ``workers``; its output kept in ``lines``."""

    def __init__(self, workers: list[str], policy: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", replicas.ROUTER_MODULE, "--host", "127.0.0.1"]
        command += ["--port", self.url.rsplit(":", 1)[1], "--worker-urls", *workers]
        command += ["--policy", policy, "--prometheus-port", str(free_port())]
        command += ["--log-level", "warn"]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not self._healthy(len(workers)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the router did not start:\n" + "\n".join(self.lines))
            time.sleep(0.1)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _healthy(self, workers: int) -> bool:
        try:
            status, _, body = request(self.url + "/readiness")
        except OSError:
            return False
        return status == 200 and json.loads(body)["healthy_workers"] == workers

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)


def post_json(url: str, body: dict) -> tuple[int, dict, bytes]:
    # the router reads a body only with this header (pyserve needs none)
    return request(url, body, method="POST", headers={"Content-Type": "application/json"})


def shared_prefix_load() -> list[tuple[int, str]]:
    """(group, prompt): each group's prompts share a long prefix of its own and differ in their
    ends; a group's prompts come one after another, so that round robin splits every group
    over both replicas."""
    words = ["river", "stone", "cloud", "lantern", "orchard", "copper", "meadow", "harbor"]
    words += ["violet", "ember", "falcon", "quartz", "willow", "thunder", "saffron", "glacier"]
    load = []
    for group in range(GROUPS):
        rng = random.Random(group)
        prefix = f"Archive {group}: " + " ".join(rng.choice(words) for _ in range(PREFIX_WORDS))
        for i in range(PER_GROUP):
            load.append((group, f"{prefix}. Question {i}: what comes after {words[i]}?"))
    return load


def serve_load(router_url: str, replica_urls: list[str]) -> list[tuple[int, int, int]]:
    """(group, prompt tokens, cached prompt tokens) of each request, sent one at a time through
    the router, from empty prefix caches."""
    for url in replica_urls:
        assert request(url + "/flush_cache", b"", method="POST")[0] == 200
        wait_for_metrics(url, lambda m: kv_idle(m) and m["pyserve_kv_blocks_cached"] == 0)
    served = []
    for group, prompt in shared_prefix_load():
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        status, _, raw = post_json(router_url + "/v1/completions", body)
        assert status == 200, raw
        usage = json.loads(raw)["usage"]
        served.append(
            (group, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
        )
    return served


def test_cache_aware_routing_serves_more_prompt_tokens_from_cache_than_round_robin(two_replicas):
    urls = [s.url for s in two_replicas]
    results = {}
    for policy in ("cache_aware", "round_robin"):
        router = Router(urls, policy)
        try:
            results[policy] = serve_load(router.url, urls)
        finally:
            router.stop()
    hits = {policy: sum(c for _, _, c in served) for policy, served in results.items()}
    misses = {policy: sum(c == 0 for _, _, c in served) for policy, served in results.items()}
    prompt_tokens = sum(p for _, p, _ in results["cache_aware"])
    # Cache-aware: one miss per group (its first prompt), then the prefix is found every time.
    # Round robin: each group's prefix is computed once on each replica.
    assert misses == {"cache_aware": GROUPS, "round_robin": 2 * GROUPS}, results
    assert hits["cache_aware"] > hits["round_robin"], results
    shortest = min(p for _, p, _ in results["cache_aware"])
    for group, _, cached in results["cache_aware"][1::PER_GROUP]:  # a group's second prompt
        assert cached >= shortest // 2, (group, results["cache_aware"])  # the whole prefix
    print(f"cached prompt tokens of {prompt_tokens}: {hits}")


def test_the_router_registers_pyserve_under_its_served_name(two_replicas):
    urls = [s.url for s in two_replicas]
    router = Router(urls, "cache_aware")
    try:
        status, _, raw = request(router.url + "/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [MODEL]
        status, _, raw = request(router.url + "/get_model_info")  # passed to a replica
        assert status == 200 and json.loads(raw)["served_model_name"] == MODEL
        status, _, raw = request(router.url + "/get_loads")  # each replica's /get_load
        loads = json.loads(raw)["workers"]
        assert status == 200 and sorted(w["worker"] for w in loads) == sorted(urls)
        assert all(w["load"] >= 0 for w in loads), loads  # -1 where a worker's answer is bad
        _, _, raw = request(urls[0] + "/server_info")
        path = json.loads(raw)["model_path"]
        body = {"model": path, "prompt": "Hello", "max_tokens": 2}  # the path names it too
        assert post_json(router.url + "/v1/completions", body)[0] == 200
    finally:
        router.stop()
    assert not [line for line in router.lines if " ERROR " in line], "\n".join(router.lines)
    # its gRPC probe (an HTTP/2 preface) is answered without an ERROR in the replicas' logs
    assert not [x for s in two_replicas for x in s.lines if " ERROR " in x]


# ----------------------------------------------------------------------------- pyserve run --dp


class Supervisor:
    """`pyserve run --dp 2` on the tiny model, once it is ready; its output kept in ``lines``."""

    def __init__(self, model_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pyserve", "run", "--dp", "2"]
        command += ["--port", str(self.port), "--model", str(model_dir), *REPLICA_ARGS]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 180
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("--dp did not start:\n" + self.log())
        self.ready_line = next(x for x in self.lines if "pyserve is ready at" in x)
        self.children = descendants(self.proc.pid)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if "pyserve is ready at" in line:
                self._ready.set()

    def log(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def left_behind(self) -> list[int]:
        """The children still alive after the supervisor's exit (waiting a little for each)."""
        deadline = time.monotonic() + 10
        while [p for p in self.children if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p for p in self.children if alive(p)]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def test_dp_runs_replicas_behind_the_router_and_sigterm_stops_them_all(model_dir):
    dp = Supervisor(model_dir)
    try:
        assert f"{dp.url} ({MODEL}, 2 replicas behind sglang-router" in dp.ready_line
        replica_urls = re.search(r"replicas: (\S+), (\S+);", dp.ready_line).groups()
        # the router, two replicas, and each replica's worker and detokenizer
        assert len(dp.children) == 7, dp.children
        for replica in replica_urls:
            assert request(replica + "/health")[0] == 200

        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 3}
        status, _, raw = post_json(dp.url + "/v1/chat/completions", body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 3

        dp.proc.send_signal(signal.SIGTERM)
        assert dp.wait() == 0, dp.log()
    finally:
        dp.kill()
    assert not dp.left_behind(), dp.log()
    # the router first: the replicas hear of the shutdown once it has stopped
    told = next(i for i, x in enumerate(dp.lines) if "stopping the router, then" in x)
    replicas_told = [i for i, x in enumerate(dp.lines) if "SIGTERM: shutting down" in x]
    assert len(replicas_told) == 2 and min(replicas_told) > told, dp.log()
    assert dp.lines[-1].endswith("pyserve.replicas: stopped"), dp.log()


def test_dp_stops_everything_when_a_replica_dies(model_dir):
    dp = Supervisor(model_dir)
    try:
        workers = [
            p for p in dp.children if b"pyserve.worker" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        os.kill(workers[0], signal.SIGKILL)  # its replica exits 1, as a lone server would
        assert dp.wait() == 1, dp.log()
    finally:
        dp.kill()
    assert not dp.left_behind(), dp.log()
    assert re.search(r"replica \d \(pid \d+\) exited with code 1: stopping the others", dp.log())


def test_dp_without_the_router_says_what_to_install(monkeypatch, caplog):
    monkeypatch.setattr(replicas, "router_installed", lambda: False)
    assert cli.main(["run", "--dp", "2"]) == 2
    assert "pip install 'pyserve[router]'" in caplog.text


# ----------------------------------------------------------------------------- settings


def test_replicas_get_every_setting_but_the_supervisors():
    parser = cli.build_parser()
    argv = ["run", "--dp=2", "--por", "8000", "--host", "0.0.0.0", "--api-key", "k"]
    argv += ["--model", "m.gguf", "--tp", "2", "--disable-radix-cache", "--no-web-ui"]
    argv += ["--kv-cache-gib", "0.5", "--router-policy", "round_robin"]
    args = parser.parse_args(argv)
    assert (args.dp, args.port, args.router_policy) == (2, 8000, "round_robin")
    assert replicas.replica_args(parser, args) == [
        "--model", "m.gguf", "--tp", "2", "--kv-cache-gib", "0.5",
        "--disable-radix-cache", "--no-web-ui",
    ]  # fmt: skip


def test_each_replica_gets_its_own_gpus_or_cpus():
    assert replicas.gpu_sets("cpu", 2, 1, None) is None
    assert replicas.gpu_sets("cuda", 2, 1, None) == ["0", "1"]
    assert replicas.gpu_sets("cuda", 2, 2, "4,5,6,7") == ["4,5", "6,7"]
    with pytest.raises(replicas.ReplicaError, match="needs 4 GPUs"):
        replicas.gpu_sets("cuda", 2, 2, "0,1")
    with pytest.raises(replicas.ReplicaError, match="--device cuda"):
        replicas.gpu_sets("cuda:1", 2, 1, None)

    two_sockets = [set(range(0, 8)), set(range(8, 16))]
    assert replicas.cpu_sets(range(16), two_sockets, 2) == [list(range(8)), list(range(8, 16))]
    # three replicas on two nodes: equal runs of the CPUs instead
    assert replicas.cpu_sets(range(6), two_sockets, 3) == [[0, 1], [2, 3], [4, 5]]
    assert replicas.cpu_sets([0], [], 2) == []  # fewer CPUs than replicas: nothing pinned
    assert replicas.parse_cpulist("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}


def test_numa_nodes_are_read_from_sysfs(tmp_path: Path):
    for node, cpus in ((0, "0-3"), (1, "4-7"), (10, "")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    assert replicas.numa_nodes(tmp_path) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
