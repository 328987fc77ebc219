"""``pyserve run --dp N``: N replicas of one model on this machine behind SGLang's model gateway.

We write no router: sglang-router (``pip install 'pyserve[router]'``) does cache-aware routing,
health checks, retries and circuit breakers, and pyserve serves the endpoints it asks of its
workers. This module only supervises the processes:

- N replicas, each a ``pyserve run`` with the same settings on a free port of 127.0.0.1. On CUDA,
  replica i sees its own GPUs (CUDA_VISIBLE_DEVICES: ``--tp`` of them each); on the CPU it is
  pinned to its share of the cores (a NUMA node, or several, where the split allows), so that
  the replicas do not fight over cores.
- Once every replica is ready, the router on the user's ``--host``/``--port``, with the replicas'
  URLs and ``--router-policy`` (cache_aware by default).
- One ready line once the router reports every replica healthy. SIGTERM/SIGINT stop the router
  first (it finishes what it routed, for up to ``--shutdown-timeout`` s), then the replicas (they
  drain too); a second signal is passed on (the replicas then stop waiting). If any child dies,
  the others are stopped and the exit code is 1.

Each child runs in its own session, so that a Ctrl-C reaches only this process, which stops the
children in order; each is started through ``python -m pyserve.replicas --parent PID ...``, which
asks the kernel (Linux) to send it SIGTERM when this process dies, so that none outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path

import aiohttp

from pyserve.engine.channels import free_port
from pyserve.lifecycle import signal_at_parent_death
from pyserve.spawn import with_package_path

log = logging.getLogger("pyserve.replicas")

ROUTER_INSTALL = "pip install 'pyserve[router]'"
ROUTER_MODULE = "sglang_router.launch_router"
# The policies of sglang-router 0.3 that need nothing more than worker URLs ("manual" needs a
# routing key in every request, "bucket" is for prefill/decode disaggregation).
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# Options of `pyserve run` that the supervisor keeps: the replicas get their own.
_SUPERVISOR_ONLY = {"dp", "router_policy", "host", "port", "api_key"}

ROUTER_READY_TIMEOUT_S = 60.0  # the router registers ready replicas within a few seconds
STOP_MARGIN_S = 15.0  # beyond --shutdown-timeout: a child's own shutdown, then SIGKILL
_POLL_S = 0.2
_MAX_LINE_BYTES = 1 << 22  # a child's longest log line (the router's debug lines are long)

# What a replica prints once listening and once ready (pyserve/cli.py). The supervisor rewrites
# them, so that its own ready line is the only "pyserve is ready at" line of its output.
_REPLICA_LISTENING = re.compile(r"\((http://\S+)/health answers 503")
_REPLICA_READY = re.compile(r"pyserve is ready at (http://\S+)")


class ReplicaError(Exception):
    """Settings that --dp cannot serve."""


# ----------------------------------------------------------------------------- settings


def router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def run_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``run`` subcommand's parser inside pyserve's top-level one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["run"]
    raise LookupError("the parser has no run command")


def replica_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """``args`` as `pyserve run` options, less those the supervisor keeps (--dp, --host, --port,
    --router-policy, --api-key: the key goes by environment, out of process listings).

    Rebuilt from the parsed values rather than filtered from argv, so that abbreviations
    (``--po 8000``) and ``--flag=value`` forms cannot slip through."""
    out: list[str] = []
    for action in run_parser(parser)._actions:
        if not action.option_strings or action.dest in _SUPERVISOR_ONLY:
            continue
        if action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false / store_const
            out.append(flag)
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def gpu_sets(device: str, replicas: int, tp: int, visible: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of each replica (``tp`` GPUs each), or None off CUDA."""
    if not device.startswith("cuda"):
        return None
    if device != "cuda":
        raise ReplicaError(
            f"--dp with --device {device}: give --device cuda, and each replica gets its own "
            "GPUs (replica i: GPUs i*tp to i*tp+tp-1 of CUDA_VISIBLE_DEVICES)"
        )
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if ids is None:  # no torch here to count them: the replicas fail at start if some are missing
        ids = [str(i) for i in range(replicas * tp)]
    if len(ids) < replicas * tp:
        raise ReplicaError(
            f"--dp {replicas} --tp {tp} needs {replicas * tp} GPUs; CUDA_VISIBLE_DEVICES "
            f"names {len(ids)} ({visible})"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(replicas)]


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> list[set[int]]:
    """The CPUs of each NUMA node (Linux); empty where the system does not say."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*/cpulist"), key=lambda p: int(p.parent.name[4:])):
        with contextlib.suppress(OSError, ValueError):
            nodes.append(parse_cpulist(path.read_text()))
    return [n for n in nodes if n]


def parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` → {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def cpu_sets(allowed: Sequence[int], nodes: list[set[int]], replicas: int) -> list[list[int]]:
    """Each replica's CPUs: whole NUMA nodes when they split evenly among the replicas (a
    socket each, on a two-socket machine with --dp 2), else equal runs of the allowed CPUs.
    Empty when there are fewer CPUs than replicas (nothing is pinned then)."""
    allowed = sorted(allowed)
    if len(allowed) < replicas:
        return []
    usable = [sorted(n & set(allowed)) for n in nodes]
    usable = [n for n in usable if n]
    if usable and len(usable) % replicas == 0:
        per = len(usable) // replicas
        return [
            [c for node in usable[i * per : (i + 1) * per] for c in node] for i in range(replicas)
        ]
    bounds = [round(i * len(allowed) / replicas) for i in range(replicas + 1)]
    return [allowed[bounds[i] : bounds[i + 1]] for i in range(replicas)]


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server listening on ``host`` (any address → loopback)."""
    return url_of({"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host), port)


def router_log_level(level: str) -> str:
    # The router logs two lines per request at info: keep it to warnings unless debugging.
    return {"debug": "debug", "info": "warn", "warning": "warn"}.get(level, "error")


# ----------------------------------------------------------------------------- children


class Child:
    """A supervised process whose output is passed on, each line prefixed with its name."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.url: str | None = None
        self.ready = asyncio.Event()
        self.exited = asyncio.ensure_future(proc.wait())
        self.output = asyncio.ensure_future(self._pass_output())

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def signal(self, signum: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)

    def describe_exit(self) -> str:
        code = self.proc.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else None
        return f"{self.name} (pid {self.proc.pid}) {how or f'exited with code {code}'}"

    async def _pass_output(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        while True:
            try:
                line = await stdout.readline()
            except ValueError:  # a line over the limit, which asyncio drops: read on regardless
                continue
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\n")
            if ready := _REPLICA_READY.search(text):
                self.url = ready.group(1)
                text = f"ready at {self.url}"
                self.ready.set()
            elif listening := _REPLICA_LISTENING.search(text):
                text = f"listening at {listening.group(1)}, loading the model"
            sys.stderr.write(f"[{self.name}] {text}\n")
            sys.stderr.flush()

    async def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s."""
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), timeout)
        except asyncio.TimeoutError:
            log.warning("%s did not stop within %.0f s: killing it", self.name, timeout)
            self.signal(signal.SIGKILL)
            await self.exited
        with contextlib.suppress(asyncio.TimeoutError):  # its last lines
            await asyncio.wait_for(self.output, 5.0)


async def spawn(
    name: str, command: list[str], env: dict[str, str], cpus: list[int] | None = None
) -> Child:
    launcher = [sys.executable, "-m", "pyserve.replicas", "--parent", str(os.getpid())]
    # the children import this pyserve, also when it was found through the working directory
    env = with_package_path(env)
    if cpus:
        launcher += ["--cpus", ",".join(map(str, cpus))]
    proc = await asyncio.create_subprocess_exec(
        *launcher,
        "--",
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        limit=_MAX_LINE_BYTES,
        start_new_session=True,  # a Ctrl-C reaches the supervisor only: it stops them in order
    )
    log.debug("started %s (pid %d): %s", name, proc.pid, " ".join(command))
    return Child(name, proc)


# ----------------------------------------------------------------------------- supervisor


class Supervisor:
    def __init__(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
        self.args = args
        self.parser = parser
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._signals = (signal.SIGTERM, signal.SIGINT)
        self._auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.failed = False  # a step of the start failed (the router never became ready)

    # -------------------------------------------------------------- life

    async def run(self) -> int:
        for signum in self._signals:
            self._loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            return await self._serve()
        finally:
            await self._stop_children()
            for signum in self._signals:
                self._loop.remove_signal_handler(signum)
            log.info("stopped")

    def _on_signal(self, signum: int) -> None:
        if self.stop.is_set():  # a second signal: the children stop waiting for their requests
            for child in self._children():
                child.signal(signal.SIGTERM)
            return
        log.info("%s: stopping the router, then the replicas", signal.Signals(signum).name)
        self.stop.set()

    def _children(self) -> list[Child]:
        return ([self.router] if self.router is not None else []) + self.replicas

    async def _serve(self) -> int:
        args = self.args
        started = time.monotonic()
        envs = self._replica_envs()
        command = [sys.executable, "-m", "pyserve", "run", "--host", "127.0.0.1"]
        command += ["--port", "0", *replica_args(self.parser, args)]
        for i, (env, cpus) in enumerate(envs):
            self.replicas.append(await spawn(f"replica {i}", command, env, cpus))
        log.info(
            "starting %d replicas of %s behind sglang-router (policy %s)",
            len(self.replicas),
            args.model or "the default model",
            args.router_policy,
        )
        if not await self._until(asyncio.gather(*(r.ready.wait() for r in self.replicas))):
            return self._exit_code()

        host = args.host
        port = args.port or free_port(host)
        metrics_port = free_port(host)
        urls = [r.url for r in self.replicas if r.url]
        router = [sys.executable, "-m", ROUTER_MODULE, "--host", host, "--port", str(port)]
        router += ["--worker-urls", *urls, "--policy", args.router_policy]
        router += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
        router += ["--log-level", router_log_level(args.log_level)]
        # It finishes the requests it routed for as long as a replica would.
        router += ["--shutdown-grace-period-secs", str(math.ceil(args.shutdown_timeout))]
        env = dict(os.environ)
        if args.api_key:  # clients then need the key at the router, which passes it on
            router += ["--api-key", args.api_key]
        self.router = await spawn("router", router, env)
        url = url_of(host, port)
        if not await self._until(self._router_ready(local_url(host, port), len(urls))):
            return self._exit_code()

        model = await self._served_model_name(urls[0])
        from pyserve.cli import curl_example

        log.info(
            "pyserve is ready at %s (%s, %d replicas behind sglang-router with policy %s, "
            "ready in %.1f s); replicas: %s; router metrics: %s/metrics; try: %s",
            url,
            model,
            len(urls),
            args.router_policy,
            time.monotonic() - started,
            ", ".join(urls),
            url_of(host, metrics_port),
            curl_example(url, model, bool(args.api_key)),
        )
        await self._until(asyncio.Event().wait())  # until a signal or a child's death
        return self._exit_code()

    def _replica_envs(self) -> list[tuple[dict[str, str], list[int] | None]]:
        args = self.args
        base = dict(os.environ)
        if args.api_key:
            base["PYSERVE_API_KEY"] = args.api_key  # `pyserve run`'s default for --api-key
        gpus = gpu_sets(args.device, args.dp, args.tp, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if gpus is not None:
            for i, ids in enumerate(gpus):
                log.info("replica %d: CUDA_VISIBLE_DEVICES=%s", i, ids)
            return [({**base, "CUDA_VISIBLE_DEVICES": ids}, None) for ids in gpus]
        cpus: list[list[int]] = []
        if not args.device.startswith("cuda") and hasattr(os, "sched_getaffinity"):
            cpus = cpu_sets(sorted(os.sched_getaffinity(0)), numa_nodes(), args.dp)
        for i, group in enumerate(cpus):
            log.info("replica %d: CPUs %s", i, ",".join(map(str, group)))
        return [(dict(base), cpus[i] if cpus else None) for i in range(args.dp)]

    async def _until(self, goal: Awaitable[object]) -> bool:
        """Waits for ``goal``; False if a signal or a child's death came first (or it failed)."""
        goal_task = asyncio.ensure_future(goal)
        stop_task = asyncio.ensure_future(self.stop.wait())
        waits = {goal_task, stop_task, *(c.exited for c in self._children())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (goal_task, stop_task):
                task.cancel()
        if self.stop.is_set() or self._dead() is not None:
            return False
        if goal_task.exception() is not None:
            log.error("%s", goal_task.exception())
            self.failed = True
            return False
        return True

    def _dead(self) -> Child | None:
        return next((c for c in self._children() if not c.alive), None)

    def _exit_code(self) -> int:
        dead = self._dead()
        if dead is not None and not self.stop.is_set():
            log.error("%s: stopping the others", dead.describe_exit())
            return 1
        return 1 if self.failed else 0

    async def _router_ready(self, url: str, replicas: int) -> None:
        """Returns once the router reports every replica healthy (its /readiness)."""
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._auth) as session:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    async with session.get(url + "/readiness") as resp:
                        if resp.status == 200:
                            body = await resp.json(content_type=None)
                            if body.get("healthy_workers", 0) >= replicas:
                                return
                await asyncio.sleep(_POLL_S)
        raise TimeoutError(
            f"the router at {url} did not report the {replicas} replicas healthy within "
            f"{ROUTER_READY_TIMEOUT_S:.0f} s"
        )

    async def _served_model_name(self, replica_url: str) -> str:
        timeout = aiohttp.ClientTimeout(total=10)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout, headers=self._auth) as session,
                session.get(replica_url + "/server_info") as resp,
            ):
                info = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("cannot read the model's name from %s: %s", replica_url, exc)
            return self.args.served_model_name or "MODEL"
        return str(info.get("served_model_name") or info.get("model"))

    async def _stop_children(self) -> None:
        """The router first (it stops taking requests and finishes those it routed), then the
        replicas together."""
        grace = self.args.shutdown_timeout + STOP_MARGIN_S
        if self.router is not None:
            await self.router.stop(grace)
        await asyncio.gather(*(r.stop(grace) for r in self.replicas))
        for child in self._children():
            log.debug("%s", child.describe_exit())


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``pyserve run --dp N``; the exit code."""
    if args.dp < 1:
        log.error("invalid settings: --dp must be at least 1 (got %d)", args.dp)
        return 2
    if not router_installed():
        log.error("--dp needs SGLang's model gateway, sglang-router: %s", ROUTER_INSTALL)
        return 2
    try:
        gpu_sets(args.device, args.dp, args.tp, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ReplicaError as exc:
        log.error("invalid settings: %s", exc)
        return 2
    if args.fairness == "tenant":  # as sglang-router 0.3.2 was seen to forward requests
        log.warning(
            "--fairness tenant with --dp: each replica is fair on its own, and the router "
            "passes the user field on for /v1/completions only (chat completions and /generate "
            "reach the replicas as the anonymous tenant)"
        )

    async def supervise() -> int:
        return await Supervisor(args, parser).run()

    try:
        import uvloop
    except ImportError:
        return asyncio.run(supervise())
    return uvloop.run(supervise())


# ----------------------------------------------------------------------------- launcher


def _exec_child(argv: list[str]) -> None:
    """``python -m pyserve.replicas --parent PID [--cpus LIST] -- COMMAND...``: becomes COMMAND,
    pinned to the CPUs, with SIGTERM from the kernel when PID (the supervisor) dies (Linux; the
    request survives exec)."""
    parser = argparse.ArgumentParser(prog="python -m pyserve.replicas")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--cpus")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not command:
        parser.error("no command")
    signal_at_parent_death(signal.SIGTERM)
    if os.getppid() != opts.parent:  # the supervisor died before the request took effect
        sys.exit(1)
    if opts.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, parse_cpulist(opts.cpus))
    os.execv(command[0], command)


if __name__ == "__main__":
    _exec_child(sys.argv[1:])
