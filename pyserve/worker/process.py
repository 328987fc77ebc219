"""The worker subprocess: ``python -m pyserve.worker --config '<json WorkerConfig>'``.

It PULLs from main (``in_addr``, bound here: every PULL end of the ring binds) and PUSHes to the
detokenizer (``out_addr``, connected). NewRequest → stored, and its detokenizer settings
forwarded as a DetokRequest; Step → forward pass + sampling → StepTokens; Shutdown → forwarded,
then exit. A step that raises yields a WorkerError naming its requests and an empty StepTokens
(so that main can still report the step to the core in order); the worker keeps serving.

With ``disk_cache_dir`` set the worker holds the disk tier under the prefix cache
(pyserve/worker/disk_tier.py): a Step's disk operations run before its forward pass, and the
loads that failed go back in StepTokens.failed_loads (main recomputes those blocks); a disk
error never fails a step. With ``--tp`` every rank holds a tier of its own shard of each block
and the ranks agree on the failed loads and the index at start (pyserve/worker/disk_ranks.py).

With ``--tp N`` the worker is N processes, ranks of one torch.distributed group
(pyserve/worker/tensor_parallel.py): rank 0 owns the ring's sockets and broadcasts every message
it takes to the others; every rank runs them alike and only rank 0 replies. A failed collective
or a step that fails in the model ends the worker (the ranks could no longer agree on where they
are), as a dead worker ends the server.

Importing this module stays light (no torch), so that the main process can build a WorkerConfig.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
import traceback
from functools import partial
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zmq

from pyserve.lifecycle import die_with_parent
from pyserve.wire import main_to_worker as inp
from pyserve.wire import worker_to_detok as out
from pyserve.worker import env
from pyserve.worker.errors import TensorParallelError
from pyserve.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from pyserve.testing.worker_hooks import WorkerTestHooks
    from pyserve.worker.disk_tier import DiskTier
    from pyserve.worker.executor import StepExecutor
    from pyserve.worker.tensor_parallel import TensorParallel


log = logging.getLogger("pyserve.worker")
# With --tp, rank 0 broadcasts an empty message after this long without one, so that the other
# ranks, waiting in a collective, never reach its timeout (tensor_parallel.COLLECTIVE_TIMEOUT).
KEEPALIVE_S = 60.0


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    in_addr: str  # ZMQ PULL from main, bound here
    out_addr: str  # ZMQ PUSH to the detokenizer, connected
    settings: WorkerSettings  # what to load and how to run it
    parent_pid: int = 0  # 0: do not watch the parent
    log_level: str = "info"
    torch_threads: int | None = None  # None: torch's default
    tp_rank: int = 0  # this process's tensor-parallel rank (only rank 0 uses the addresses)
    tp_size: int = 1
    tp_init: str = ""  # torch.distributed's init_method, with tp_size > 1


def run(config: WorkerConfig) -> int:
    """Serves until Shutdown (returns 0), a load failure or a broken tensor-parallel group
    (returns 1)."""
    rank = f" rank {config.tp_rank}" if config.tp_size > 1 else ""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker{rank}: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    if config.parent_pid:
        die_with_parent(config.parent_pid)

    ctx = zmq.Context()
    pull = push = None
    if config.tp_rank == 0:
        pull = ctx.socket(zmq.PULL)
        pull.bind(config.in_addr)
        push = ctx.socket(zmq.PUSH)
        push.connect(config.out_addr)
    hooks = _test_hooks()
    tier: DiskTier | None = None
    try:
        if hooks is not None:
            hooks.before_loading()
        tp = _join_group(config) if config.tp_size > 1 else None
        started = time.perf_counter()
        executor, error = _load(config, tp)
        if tp is not None:
            error = tp.agree_loaded(error)  # every rank loaded, or the first one's error
        if error is not None or executor is None:
            log.error("%s", error)
            if push is not None:
                push.send(out.encoder.encode(out.WorkerError(message=error or "load failed")))
            return 1
        tier = _open_disk_tier(config, executor, tp)
        disk = _disk_index(tier, tp)
        if push is not None:
            load_seconds = time.perf_counter() - started
            log.info("model loaded in %.1f s", load_seconds)
            if tier is not None:
                log.info("disk KV tier: %s, blocks of %d bytes", tier.directory, disk[1])
            push.send(out.encoder.encode(_ready(config, executor, load_seconds, tier, disk)))
        _serve(executor, pull, push, hooks, tp, tier)
        return 0
    except TensorParallelError as e:
        log.error("%s; the worker stops", e)
        if push is not None:
            push.send(out.encoder.encode(out.WorkerError(message=f"{e}; the worker stops")))
        return 1
    finally:
        if tier is not None:
            tier.close()  # a no-op after a Shutdown, which closed it
        for sock in (pull, push):
            if sock is not None:
                # let the last message (Shutdown, an error) reach the detokenizer
                sock.close(linger=2000 if sock is push else 0)
        ctx.term()


def _test_hooks() -> WorkerTestHooks | None:
    """The test hooks set in the environment, or None (always, outside the tests)."""
    switches = env.hook_switches()
    if not switches.any_set():
        return None
    from pyserve.testing.worker_hooks import WorkerTestHooks

    return WorkerTestHooks(switches)


def _join_group(config: WorkerConfig) -> TensorParallel:
    from pyserve.worker.tensor_parallel import TensorParallel

    try:
        return TensorParallel.join(
            config.tp_rank, config.tp_size, config.tp_init, config.settings.device
        )
    except Exception as e:
        raise TensorParallelError(f"could not join the tensor-parallel group: {e}") from e


def preload() -> None:
    """Imports what ``_load`` will (torch and the model code: most of a start), before the
    config is known."""
    import torch  # noqa: F401

    from pyserve.worker import executor, grammar_masks, model_runner  # noqa: F401


def _load(
    config: WorkerConfig, tp: TensorParallel | None
) -> tuple[StepExecutor | None, str | None]:
    """(the StepExecutor over a freshly loaded ModelRunner, None), or (None, what failed)."""
    try:
        import torch

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        from pyserve.worker.executor import StepExecutor
        from pyserve.worker.grammar_masks import GrammarMasks
        from pyserve.worker.model_runner import ModelRunner

        settings = config.settings
        if settings.draft_model is not None and config.tp_size > 1:
            return None, (
                f"the draft model {settings.draft_model} cannot run with --tp "
                f"{config.tp_size}: speculative decoding with a draft model needs one rank"
            )
        runner = ModelRunner(settings, tp=tp)
        drafter = None
        if settings.draft_model is not None:
            from pyserve.worker.draft_model import DraftModel, load_draft_runner

            drafter = DraftModel(
                load_draft_runner(settings, runner), device=runner.device, seed=settings.seed
            )
        eos_token_ids = list(runner.config.eos_token_ids)
        executor = StepExecutor(
            runner,
            block_size=settings.block_size,
            eos_token_ids=eos_token_ids,
            device=runner.device,
            seed=settings.seed,
            grammars=GrammarMasks(
                partial(_tokenizer_file, settings.model), runner.config.vocab_size, eos_token_ids
            ),
            tp=tp,
            drafter=drafter,
            **runner.executor_options(),
        )
    except TensorParallelError:
        raise
    except Exception as e:
        log.debug("load failed:\n%s", traceback.format_exc())
        model = config.settings.model or "(default)"
        return None, f"the worker could not load the model {model}: {e}"
    # The model, torch and transformers live as long as the worker: frozen, a full collection
    # (the per-step objects trigger one now and then) no longer walks their ~180k objects in the
    # middle of a step, where one would stall the step by a long pause.
    gc.collect()
    gc.freeze()
    return executor, None


def _open_disk_tier(
    config: WorkerConfig, executor: StepExecutor, tp: TensorParallel | None = None
) -> DiskTier | None:
    """The disk tier when ``disk_cache_dir`` asks for one and this worker can hold it (with
    ``tp``, this rank's, on every rank or none)."""
    directory = config.settings.disk_cache_dir
    if not directory:
        return None
    if tp is not None:
        from pyserve.worker.disk_ranks import open_rank_tier

        return open_rank_tier(directory, executor.runner, tp)
    from pyserve.worker.disk_tier import open_disk_tier

    drafter = executor.drafter
    try:
        return open_disk_tier(
            directory, executor.runner, drafter.runner if drafter is not None else None
        )
    except OSError as e:
        log.warning("disk KV tier: cannot use %s (%s); running without it", directory, e)
        return None


def _disk_index(tier: DiskTier | None, tp: TensorParallel | None) -> tuple[bytes, int]:
    """(WorkerReady.disk_index, .disk_block_bytes); with ``tp``, the group's (every rank calls
    this)."""
    if tier is None:
        return b"", 0
    if tp is not None:
        from pyserve.worker.disk_ranks import agree_index

        return agree_index(tp, tier)
    return tier.listed_index() or b"", tier.block_bytes


def _ready(
    config: WorkerConfig,
    executor: StepExecutor,
    load_seconds: float,
    tier: DiskTier | None,
    disk: tuple[bytes, int] = (b"", 0),
) -> out.WorkerReady:
    """``disk``: ``_disk_index``'s answer."""
    runner = executor.runner
    backend = runner.backend.info()
    return out.WorkerReady(
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        dtype=runner.dtype_name,
        device=config.settings.device,
        quantization=runner.quantization,
        kv_cache_dtype=runner.kv_cache_dtype_name,
        load_seconds=load_seconds,
        # every rank holds a pool of its own kv heads, of the same size
        kv_cache_bytes=int(getattr(runner, "kv_cache_bytes", 0)) * config.tp_size,
        weight_bytes=int(getattr(runner, "weight_bytes", 0)) * config.tp_size,
        architecture=runner.config.architecture,
        features=runner.config.features(),
        backend=backend.name,
        backend_reason=backend.reason,
        kernels=backend.kernels,
        tp_size=config.tp_size,
        disk_tier=str(tier.directory) if tier is not None else "",
        disk_block_bytes=disk[1] if tier is not None else 0,
        disk_index=disk[0],
    )


def _tokenizer_file(model: str | None) -> str:
    """The tokenizer main loaded (its cached conversion for a GGUF): by the first request,
    main has made sure it exists."""
    from pyserve import model_files

    return str(model_files.tokenizer_dir(model_files.resolve_model(model)) / "tokenizer.json")


def _serve(
    executor: StepExecutor,
    pull: zmq.Socket | None,
    push: zmq.Socket | None,
    hooks: WorkerTestHooks | None,
    tp: TensorParallel | None,
    tier: DiskTier | None = None,
) -> None:
    decode = inp.decoder.decode
    encode = out.encoder.encode
    fatal = tp is not None  # a step failing in the model ends a tensor-parallel worker
    busy_seconds, steps = 0.0, 0  # running totals, carried on every StepTokens
    while True:
        frames = _next_frames(pull, tp)
        for frame in frames:
            started = time.perf_counter()  # busy from holding a message to sending its replies
            try:
                msg = decode(frame)
            except msgspec.DecodeError as e:
                replies = _reject_unchecked(executor, frame, e)
                if replies is None:
                    log.error("dropped a malformed message: %s", e)
                    continue
            else:
                if isinstance(msg, inp.Step):
                    if hooks is not None:
                        hooks.before_step()
                    replies = _run_step(executor, msg, fatal, tier, tp)
                    steps += 1
                    tokens = replies[-1]  # the StepTokens comes last
                    tokens.busy_seconds = busy_seconds + (time.perf_counter() - started)
                    tokens.steps = steps
                elif isinstance(msg, inp.NewRequest):
                    replies = _add_request(executor, msg)
                else:  # Shutdown
                    if push is not None:
                        push.send(encode(out.Shutdown()))
                    log.info("shutting down")
                    if tier is not None:
                        # after forwarding Shutdown: main then waits for this process to exit,
                        # which leaves the queued writes time to finish
                        if tier.store.pending:
                            log.info("disk KV tier: writing %d queued blocks", tier.store.pending)
                        tier.close()
                    return
            if push is not None:
                for reply in replies:
                    push.send(encode(reply))
            busy_seconds += time.perf_counter() - started


def _next_frames(pull: zmq.Socket | None, tp: TensorParallel | None) -> list[bytes]:
    """The next messages: everything queued on the ring (waiting for one), or rank 0's
    broadcast of them on the other ranks."""
    if pull is None:
        assert tp is not None
        return tp.broadcast_frames(None)  # [] from a keepalive
    if tp is not None and not pull.poll(KEEPALIVE_S * 1000):
        return tp.broadcast_frames([])  # the other ranks are waiting in a collective
    frames = [pull.recv()]
    while True:  # take everything already queued before blocking again
        try:
            frames.append(pull.recv(zmq.NOBLOCK))
        except zmq.Again:
            break
    if tp is not None:
        tp.broadcast_frames(frames)
    return frames


def _add_request(executor: StepExecutor, msg: inp.NewRequest) -> list[msgspec.Struct]:
    try:
        state = executor.add_request(msg)
    except Exception as e:
        return _reject(executor, msg, e)
    prompt = msg.prompt_ids
    if msg.images:  # the detokenizer's context holds the image token, never an image's ids
        prompt = state.prompt_ids.numpy().astype("<i4").tobytes()
    return [out.DetokRequest(rid=msg.rid, prompt_ids=prompt, params=msg.detok)]


def _reject_unchecked(
    executor: StepExecutor, frame: bytes, error: Exception
) -> list[msgspec.Struct] | None:
    """The replies rejecting a NewRequest whose values failed the wire checks (so that its rid
    is failed, not left waiting); None for any other undecodable message."""
    try:
        request = inp.unchecked_request_decoder.decode(frame)
    except msgspec.DecodeError:
        return None
    return _reject(executor, request, error)


def _reject(
    executor: StepExecutor, msg: inp.NewRequest | inp.UncheckedNewRequest, error: Exception
) -> list[msgspec.Struct]:
    log.warning("request %d rejected: %s", msg.rid, error)
    executor.requests.add_rejected(msg)
    rid = np.asarray([msg.rid], dtype="<i8").tobytes()
    return [
        out.WorkerError(message=f"invalid request {msg.rid}: {error}", rids=rid),
        # a rejected request's ids may be an image's: no context for its (discarded) tokens
        out.DetokRequest(
            rid=msg.rid, prompt_ids=b"" if msg.images else msg.prompt_ids, params=msg.detok
        ),
    ]


def _run_step(
    executor: StepExecutor,
    step: inp.Step,
    fatal: bool,
    tier: DiskTier | None = None,
    tp: TensorParallel | None = None,
) -> list[msgspec.Struct]:
    """The step's StepTokens, after its disk operations; with ``fatal``, a failure past the
    request table's checks ends the worker (TensorParallelError)."""
    from pyserve.worker.executor import MalformedStep

    failed_loads = _disk_ops(tier, step, tp)
    try:
        tokens = executor.execute(step)
        tokens.worker_requests = len(executor.requests)  # for main's idle accounting check
        tokens.failed_loads = failed_loads
        return [tokens]
    except TensorParallelError:
        raise
    except Exception as e:
        if fatal and not isinstance(e, MalformedStep):
            log.error("step %d failed:\n%s", step.step_id, traceback.format_exc())
            raise TensorParallelError(f"step {step.step_id} failed on this rank: {e!r}") from e
        log.error("step %d failed:\n%s", step.step_id, traceback.format_exc())
        rids, dropped = _whole(step.rids, 8), _whole(step.dropped, 8)
        executor.requests.fail(rids)
        error = out.WorkerError(message=f"step {step.step_id} failed: {e!r}", rids=rids)
        # an empty result keeps main's in-order step accounting going
        empty = out.StepTokens(
            step_id=step.step_id,
            rids=b"",
            token_ids=b"",
            finish=b"",
            dropped=dropped,
            worker_requests=len(executor.requests),
            failed_loads=failed_loads,  # the loads ran: main must still hear which failed
        )
        return [error, empty]


def _disk_ops(tier: DiskTier | None, step: inp.Step, tp: TensorParallel | None = None) -> bytes:
    """Does the step's disk operations; the int32 load block ids that failed (with ``tp``, on
    any rank). Never raises but for a failed collective: a disk error (or a malformed op) costs
    the step's loads, which main then recomputes."""
    if not (step.save_blocks or step.load_blocks or step.drop_keys or step.clear_disk):
        return b""
    loads = _whole(step.load_blocks, 4)
    if tier is None:  # no tier here (nor on any rank): nothing is saved, and nothing can load
        return loads
    blocks = np.frombuffer(loads, dtype="<i4").tolist()
    try:
        failed = tier.apply(step)
    except Exception:
        log.error("step %d: disk ops failed:\n%s", step.step_id, traceback.format_exc())
        failed = blocks
    if tp is not None:  # every rank holds the step's blocks: a failure anywhere is everyone's
        from pyserve.worker.disk_ranks import agree_failed_loads

        failed = agree_failed_loads(tp, blocks, failed)
    return np.asarray(failed, dtype="<i4").tobytes()


def _whole(packed: bytes, size: int) -> bytes:
    """``packed`` cut to whole ``size``-byte ints: a garbled Step must not break the error
    path too."""
    return packed[: len(packed) // size * size]
