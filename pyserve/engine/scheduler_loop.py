"""The scheduler loop: a dedicated thread that drives the C++ Planner and main's two sockets.

Every Planner call and every socket operation happens on this thread, so neither needs a lock;
the event loop talks to it through a command queue (plus a pipe that wakes its poll) and it
answers with one ``loop.call_soon_threadsafe`` per completed step, never one per token.

Overlap (DESIGN.md): the thread keeps up to two Steps in flight, so it plans Step N+1 while the
worker computes Step N and the worker always has its next Step queued. The Planner's hot calls
release the GIL, so HTTP work on the event loop does not starve planning and vice versa.

The thread also watches the Steps it has sent (step_watch.py): one left unanswered past
``step_timeout`` makes the engine unhealthy until it completes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from pyserve.engine.channels import RingAddresses, main_sockets
from pyserve.engine.errors import EngineDeadError, EngineError, EngineStartError
from pyserve.engine.idle_check import IdleWatch, core_problems
from pyserve.engine.step_costs import StepCosts
from pyserve.engine.step_watch import Stall, StepWatch
from pyserve.engine.subprocesses import Children
from pyserve.wire import detok_to_main as inp
from pyserve.wire import main_to_worker as out

log = logging.getLogger("pyserve.engine")

MAX_INFLIGHT_STEPS = 2
POLL_MS = 200  # longest wait without looking at the children and the stop flag
STATS_EVERY_S = 0.1
LOG_EVERY_S = 10.0
MAX_COSTED_TOKENS = 256  # decode steps measured for speculation: up to this many tokens


def whole_spans(images: list[out.ImageInput]) -> bytes:
    """The prompt spans no prefill chunk may split, as the Planner takes them (int32
    ``[start, end)`` pairs, ascending): every maximal run of consecutive positions of an image,
    whose positions may attend to each other within one forward pass (Gemma 3's do)."""
    runs = []
    for image in images:
        pos = np.frombuffer(image.positions, dtype="<i4").astype(np.int64)
        if not len(pos):
            continue
        cuts = np.flatnonzero(np.diff(pos) != 1) + 1
        starts = pos[np.concatenate(([0], cuts))]
        ends = pos[np.concatenate((cuts - 1, [len(pos) - 1]))] + 1
        runs.append(np.stack((starts, ends), axis=1))
    if not runs:
        return b""
    spans = np.concatenate(runs)
    spans = spans[np.argsort(spans[:, 0], kind="stable")]  # images in any order
    return spans.astype("<i4").tobytes()


class EngineSink(Protocol):
    """What the thread calls on the event loop (through call_soon_threadsafe)."""

    def on_ready(self, ready: inp.Ready) -> None: ...
    # per delta: (delta, the prompt tokens served from the prefix cache on the request's first
    # delta, the drafts it had accepted on its last delta when speculating; else None)
    def on_step(self, deltas: list[tuple[inp.RequestDelta, int | None, int | None]]) -> None: ...
    def on_request_error(self, rids: list[int] | None, error: Exception) -> None: ...
    def on_fatal(self, error: Exception) -> None: ...
    def on_idle(self, problems: list[str], last_submitted_rid: int) -> None: ...
    def on_stall(self, stall: Stall | None) -> None: ...


class SchedulerLoop:
    def __init__(
        self,
        *,
        addresses: RingAddresses,
        children: Children,
        make_planner: Callable[[inp.Ready], Any],
        loop: asyncio.AbstractEventLoop,
        sink: EngineSink,
        ready_timeout: float,
        shutdown_timeout: float,
        step_timeout: float = 0.0,
        speculative: bool = False,
    ) -> None:
        self._addresses = addresses
        self._children = children
        self._make_planner = make_planner
        self._loop = loop
        self._sink = sink
        self._ready_timeout = ready_timeout
        self._shutdown_timeout = shutdown_timeout
        self._speculative = speculative  # finished requests report their accepted drafts
        # with speculation: what decode steps cost, for the planner's drafts (step_costs.py)
        self._costs = StepCosts(MAX_COSTED_TOKENS) if speculative else None
        self._costed: dict[int, bool] = {}  # sent decode-only step -> whether it verifies
        self._last_done: tuple[float, bool] | None = None  # (when, whether it verified)
        self._commands: collections.deque[tuple] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._exited = False
        self._thread = threading.Thread(target=self._run, name="pyserve-scheduler", daemon=True)
        # Owned by the thread:
        self._planner: Any = None
        self._live: set[int] = set()  # rids added to the planner and not yet finished/aborted
        self._awaiting_cached: set[int] = set()  # rids whose cached_tokens main has not had
        self._num_blocks = 0
        self._stopping = False
        self._stopped_cleanly = False
        self._generated_since_log = 0
        self._last_log = time.monotonic()
        self._last_stats = 0.0
        # What the worker and the detokenizer said they hold, as of the last StepDone.
        self._worker_requests = 0
        self._detokenizer_requests = 0
        self._worker_busy_seconds = 0.0  # the worker's running totals, as of the last StepDone
        self._worker_steps = 0
        self._handed_tokens = 0  # tokens handed to live requests since start
        self._last_submitted_rid = 0
        self._idle_watch = IdleWatch()
        self._step_watch = StepWatch(step_timeout)
        self.snapshot: dict = {}  # the planner's stats, refreshed by the thread (read anywhere)

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._thread.start()

    def submit(self, rid: int, request: out.NewRequest, priority: int = 0, tenant: int = 0) -> None:
        self._command(("add", rid, request, priority, tenant))

    def abort(self, rid: int) -> None:
        self._command(("abort", rid))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Runs ``fn(planner)`` on the thread; the future has its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("call", fn, future))
        return future

    def stop(self) -> None:
        """Asks the thread to shut the ring down (Shutdown → worker → detokenizer → Stopped)."""
        self._command(("stop",))

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Releases the wake-up pipe once the thread has ended (called on the event loop)."""
        if not self._closed and not self._thread.is_alive():
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    @property
    def stopped_cleanly(self) -> bool:
        return self._stopped_cleanly

    def _command(self, command: tuple) -> None:
        self._commands.append(command)
        if self._exited:  # nobody will run it: fail it here (the thread set the flag first)
            self._fail_pending_calls()
            return
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread is awake already
            os.write(self._wake_w, b"x")

    # ------------------------------------------------------------------ thread side

    def _post(self, fn: Callable, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens any more
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        ctx = zmq.Context()
        self._to_worker, self._from_detok, monitor = main_sockets(ctx, self._addresses)
        self._poller = zmq.Poller()
        self._poller.register(self._from_detok, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        try:
            ready = self._wait_ready()
            if ready is not None:
                self._remove_ring_files(monitor)
                self._planner = self._make_planner(ready)
                self._num_blocks = ready.num_blocks
                self._take_snapshot()
                self._post(self._sink.on_ready, ready)
                self._serve()
        except EngineError as e:
            log.error("%s", e)
            self._post(self._sink.on_fatal, e)
        except BaseException as e:
            log.exception("the scheduler loop failed")
            self._post(self._sink.on_fatal, EngineDeadError(f"the scheduler loop failed: {e!r}"))
        finally:
            self._exited = True
            self._fail_pending_calls()
            monitor.close(linger=0)
            self._to_worker.close(linger=0)
            self._from_detok.close(linger=0)
            ctx.term()

    def _wait_ready(self) -> inp.Ready | None:
        deadline = time.monotonic() + self._ready_timeout
        while True:
            if any(command[0] == "stop" for command in self._commands):
                self._stopping = True
                return None  # other commands wait for the planner; stop fails their calls
            dead = self._children.first_dead()
            if dead is not None:
                raise_start(f"{dead.describe_exit()} while starting (its log is above)")
            if time.monotonic() > deadline:
                raise_start(f"the model did not load within {self._ready_timeout:.0f} s")
            if self._from_detok.poll(POLL_MS, zmq.POLLIN):
                msg = inp.decoder.decode(self._from_detok.recv())
                if isinstance(msg, inp.Ready):
                    return msg
                if isinstance(msg, inp.WorkerError):
                    raise_start(f"the worker failed while starting: {msg.message}")

    def _remove_ring_files(self, monitor: zmq.Socket) -> None:
        """Ready has come round the ring, so worker → detokenizer → main are connected; once
        main → worker is too, the socket files (and the tokenizer file) have done their job."""
        if monitor.poll(5000, zmq.POLLIN):
            recv_monitor_message(monitor)
            self._addresses.remove()
        else:
            log.warning("main's connection to the worker is slow; keeping the IPC files")
        self._to_worker.disable_monitor()

    def _take_commands(self) -> list[tuple]:
        taken = []
        while self._commands:
            taken.append(self._commands.popleft())
        return taken

    def _serve(self) -> None:
        next_child_check = 0.0
        while True:
            commands = self._take_commands()
            for command in commands:
                self._run_command(command)
            if self._stopping:
                self._shutdown_ring()
                return
            self._plan_ahead()
            events = self._poller.poll(POLL_MS)
            for sock, _ in events:
                if sock == self._wake_r:
                    os.read(self._wake_r, 4096)
                else:
                    self._drain_results()
            now = time.monotonic()
            if commands or events:
                self._idle_watch.activity(now)
            if now >= next_child_check:
                next_child_check = now + POLL_MS / 1000
                dead = self._children.first_dead()
                if dead is not None:
                    raise EngineDeadError(f"{dead.describe_exit()}; the engine cannot go on")
                if self._step_watch.check(now):
                    self._post(self._sink.on_stall, self._step_watch.stall)
            if now - self._last_stats >= STATS_EVERY_S or not self._live:
                self._refresh_stats(now)
            idle = not self._live and self._planner.num_inflight_steps == 0
            if self._idle_watch.check_now(now, idle):
                self._check_idle()

    def _run_command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, request, priority, tenant = command
            try:
                pooling = request.pooling
                self._planner.add_request(
                    rid,
                    request.prompt_ids,
                    request.sampling.max_new_tokens,
                    match_prefix=pooling is None or not pooling.needs_every_position,
                    whole_spans=whole_spans(request.images) if request.images else b"",
                    priority=priority,
                    tenant=tenant,
                )
            except (ValueError, KeyError) as e:
                self._post(self._sink.on_request_error, [rid], ValueError(str(e)))
                return
            self._send(request)  # before the first Step that names it
            self._live.add(rid)
            self._last_submitted_rid = max(self._last_submitted_rid, rid)
            self._awaiting_cached.add(rid)
        elif kind == "abort":
            rid = command[1]
            if rid in self._live:
                self._planner.abort(rid)
                self._forget(rid)
        elif kind == "call":
            _, fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self._planner))
                except BaseException as e:
                    future.set_exception(e)
        elif kind == "stop":
            self._stopping = True

    def _plan_ahead(self) -> None:
        planner = self._planner
        while planner.num_inflight_steps < MAX_INFLIGHT_STEPS:
            step = planner.plan()
            if step is None:
                return
            msg = out.step_from_plan(step)
            if self._costs is not None and step.num_prefill_tokens == 0:
                # every entry decodes: more tokens than entries, some verify
                self._costed[msg.step_id] = step.num_decode_tokens > len(msg.is_decode)
            self._send(msg)
            self._step_watch.sent(msg.step_id, len(msg.rids) // 8, time.monotonic())

    def _send(self, msg: out.NewRequest | out.Step | out.Shutdown) -> None:
        self._to_worker.send(out.encoder.encode(msg), copy=False)

    def _drain_results(self) -> None:
        while True:
            try:
                frame = self._from_detok.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = inp.decoder.decode(frame.buffer)
            if isinstance(msg, inp.StepDone):
                self._on_step_done(msg)
            elif isinstance(msg, inp.WorkerError):
                self._on_worker_error(msg)
            elif isinstance(msg, inp.Stopped):
                log.warning("the ring stopped without being asked to")

    def _on_step_done(self, msg: inp.StepDone) -> None:
        planner = self._planner
        if msg.failed_loads:  # damaged or missing block files: recomputed instead
            log.warning(
                "disk cache: %d block(s) failed to load in step %d; recomputing them",
                len(msg.failed_loads) // 4,
                msg.step_id,
            )
            planner.fail_loads(msg.step_id, msg.failed_loads)
        planner.report(msg.step_id, msg.rids, msg.token_ids)
        if self._costs is not None:
            self._measure(msg)
        self._step_watch.done(msg.step_id, time.monotonic())
        self._worker_requests = msg.worker_requests
        self._detokenizer_requests = msg.detokenizer_requests
        self._worker_busy_seconds = msg.worker_busy_seconds
        self._worker_steps = msg.worker_steps
        handed: list[tuple[inp.RequestDelta, int | None, int | None]] = []
        for delta in msg.deltas:
            rid = delta.rid
            if rid not in self._live:
                continue  # aborted while this step was in flight
            cached = None
            if rid in self._awaiting_cached:
                self._awaiting_cached.discard(rid)
                cached = planner.request(rid)["cached_tokens"]
            accepted = None
            if delta.finish_reason is not None:
                if self._speculative:
                    accepted = planner.request(rid)["spec_accepted"]
                planner.finish(rid)
                self._forget(rid)
            handed.append((delta, cached, accepted))
        self._generated_since_log += len(msg.deltas)
        self._handed_tokens += len(handed)
        if not self._live:
            # the last request ended: /metrics read after its response must show its effects,
            # not the snapshot from before it (a short request can run between two refreshes)
            self._take_snapshot()
        if handed:
            self._post(self._sink.on_step, handed)

    def _measure(self, msg: inp.StepDone) -> None:
        """Feeds StepCosts: the worker's time for a decode-only step, and the worker's wait
        after a step with verify entries."""
        assert self._costs is not None
        now = time.monotonic()
        verifies = self._costed.pop(msg.step_id, None)
        # as the worker ran it: a chained entry may have run as a plain decode (0: a failed step)
        tokens = msg.computed_tokens if verifies is not None else 0
        if tokens:
            self._costs.observe(tokens, msg.forward_ms, now)
            if self._last_done is not None and self._last_done[1]:
                self._costs.observe_overhead((now - self._last_done[0]) * 1e3, msg.forward_ms)
        self._last_done = (now, bool(verifies))

    def _on_worker_error(self, msg: inp.WorkerError) -> None:
        rids = np.frombuffer(msg.rids, dtype="<i8").tolist() if msg.rids else sorted(self._live)
        log.error("worker error for %d request(s): %s", len(rids), msg.message)
        for rid in rids:
            if rid in self._live:
                self._planner.abort(rid)
                self._forget(rid)
        self._post(self._sink.on_request_error, rids, EngineError(msg.message))

    def _forget(self, rid: int) -> None:
        self._live.discard(rid)
        self._awaiting_cached.discard(rid)
        self._idle_watch.request_ended()

    def _check_idle(self) -> None:
        problems = core_problems(
            self._planner,
            live_requests=len(self._live),
            worker_requests=self._worker_requests,
            detokenizer_requests=self._detokenizer_requests,
        )
        self._post(self._sink.on_idle, problems, self._last_submitted_rid)

    def _take_snapshot(self) -> None:
        self.snapshot = {
            **self._planner.stats(),
            "live_requests": len(self._live),
            "worker_requests": self._worker_requests,
            "detokenizer_requests": self._detokenizer_requests,
            "worker_busy_seconds": self._worker_busy_seconds,
            "worker_steps": self._worker_steps,
            "handed_tokens": self._handed_tokens,
            "oldest_step_age_seconds": self._step_watch.oldest_age(time.monotonic()),
            "worker_stalls": self._step_watch.stalls,
        }

    def _refresh_stats(self, now: float) -> None:
        costs = self._costs
        if costs is not None:
            costs.expire(now)
        if costs is not None and costs.changed:
            self._planner.set_decode_costs(costs.table(), costs.verify_overhead_ms)
            if log.isEnabledFor(logging.DEBUG):
                measured = {t: round(ms, 2) for t, ms in enumerate(costs.table()) if ms > 0}
                log.debug(
                    "decode step costs (ms by tokens): %s; verify overhead %.2f ms",
                    measured,
                    costs.verify_overhead_ms,
                )

            costs.changed = False
        self._take_snapshot()
        self._last_stats = now
        if now - self._last_log >= LOG_EVERY_S:
            if self._generated_since_log or self._live:
                self._log_load(now)
            self._last_log = now
            self._generated_since_log = 0

    def _log_load(self, now: float) -> None:
        s = self.snapshot
        used = 1.0 - s["num_free_blocks"] / max(1, self._num_blocks)
        hit = s["hit_tokens"] / s["query_tokens"] if s.get("query_tokens") else 0.0
        log.info(
            "running %d, queued %d, KV usage %.1f%%, cache hit rate %.1f%%, "
            "generation %.1f tokens/s",
            s["num_running"],
            s["num_waiting"],
            100 * used,
            100 * hit,
            self._generated_since_log / max(1e-9, now - self._last_log),
        )

    def _shutdown_ring(self) -> None:
        """Aborts what is left, sends Shutdown and waits for Stopped to come round the ring."""
        for rid in list(self._live):
            self._planner.abort(rid)
            self._forget(rid)
        self._spill_to_disk()
        self._send(out.Shutdown())
        deadline = time.monotonic() + self._shutdown_timeout
        while time.monotonic() < deadline:
            if self._children.first_dead() is not None and not self._from_detok.poll(0):
                break
            if not self._from_detok.poll(POLL_MS, zmq.POLLIN):
                continue
            msg = inp.decoder.decode(self._from_detok.recv())
            if isinstance(msg, inp.Stopped):
                self._stopped_cleanly = True
                return
        log.warning("the ring did not confirm its shutdown within %.0f s", self._shutdown_timeout)

    def _spill_to_disk(self) -> None:
        """With the disk tier: the prefix cache's RAM blocks go to disk, so that the next start
        finds them (one last step of saves; the worker finishes writing before it exits)."""
        planner = self._planner
        if planner is None or not planner.spill_to_disk():
            return
        # every request has ended: one step carries the drops, the saves and the files past
        # the budget to delete
        step = planner.plan()
        if step is not None:
            self._send(out.step_from_plan(step))

    def _fail_pending_calls(self) -> None:
        """Fails the calls nobody will run; runs on either thread (deque pops are atomic)."""
        for command in self._take_commands():
            if command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(EngineDeadError("the engine has stopped"))


def raise_start(message: str) -> None:
    raise EngineStartError(message)
