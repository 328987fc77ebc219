"""Engine: the Python API of pyserve, and the owner of its subprocesses.

``engine = Engine(config); await engine.start()`` (or ``engine = await Engine.start(config)``)
launches the worker and the detokenizer, joins them into the ZMQ ring and waits for Ready.
``generate`` / ``chat`` are async generators of GenerationChunks; closing one (or cancelling the
task that iterates it) aborts its request. The main process never imports torch.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import heapq
import importlib.metadata
import itertools
import logging
import os
import platform
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pyserve import early_worker, model_files
from pyserve.detokenizer.process import DetokenizerConfig
from pyserve.engine import embeddings, idle_check
from pyserve.engine.channels import RingAddresses, free_port
from pyserve.engine.config import EngineConfig
from pyserve.engine.disk_index import restore_disk_tier
from pyserve.engine.errors import EngineDeadError, EngineError, KVCacheTooSmall
from pyserve.engine.image_prompts import (
    MAX_TOKEN_ID,
    ImagePrompt,
    ImagePrompts,
    PromptImage,
    with_image_ids,
)
from pyserve.engine.requests import RequestRegistry, RequestState
from pyserve.engine.scheduler_loop import SchedulerLoop
from pyserve.engine.step_watch import Stall
from pyserve.engine.subprocesses import Children
from pyserve.engine.tenants import ANONYMOUS, MAX_NAME_CHARS, TenantIds
from pyserve.engine.tokenizer_manager import TokenizerManager
from pyserve.mmproj import Mmproj, MmprojError, check_pairing, read_mmproj
from pyserve.outputs import Embedding, GenerationChunk, RerankResult
from pyserve.wire.detok_to_main import Ready, RequestDelta
from pyserve.wire.main_to_worker import (
    DetokParams,
    Grammar,
    ImageInput,
    NewRequest,
    Pooling,
    SamplingParams,
    check_sampling,
)
from pyserve.worker.process import WorkerConfig  # light: no torch
from pyserve.worker.settings import tp_split_problem

log = logging.getLogger("pyserve.engine")

TOP_TENANTS = 16  # tenants that stats() names: /metrics' labels and the dashboard's rows


class _StartMethod:
    """Lets ``start`` be called both ways: ``await Engine.start(config)`` builds and starts an
    engine; ``await engine.start()`` starts an existing one. Both return the engine."""

    def __init__(self, method: Any) -> None:
        self._method = method
        functools.update_wrapper(self, method)

    def __get__(self, engine: Engine | None, cls: type[Engine]) -> Any:
        if engine is not None:
            return functools.partial(self._method, engine)

        async def build_and_start(config: EngineConfig | None = None) -> Engine:
            return await self._method(cls(config))

        return build_and_start


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._registry = RequestRegistry()
        self._core_rids = itertools.count(1)
        self._ready: Ready | None = None
        self._ready_future: asyncio.Future | None = None
        self._failure: BaseException | None = None
        self._failed = asyncio.Event()
        self._closing = False
        self._closed = False
        self._source: model_files.ModelSource | None = None
        self._info: model_files.ModelInfo | None = None
        self._tokenizers: TokenizerManager | None = None
        self._addresses: RingAddresses | None = None
        self._children = Children()
        self._scheduler: SchedulerLoop | None = None
        self._context_length = 0
        self._idle_checks = 0
        self._idle_check_failures = 0
        self._stall: Stall | None = None  # a step the worker has not answered in time
        self._embedding: embeddings.EmbeddingModel | None = None
        self._mmproj: Mmproj | None = None  # llama.cpp's --mmproj file, read at start
        self._tenants = TenantIds(served=self._tenant_tokens)  # names under fairness="tenant"
        self._tenant_of: dict[int, int] = {}  # core rid → its tenant id, while in the registry

    # ------------------------------------------------------------------ life cycle

    @_StartMethod
    async def start(self) -> Engine:
        if self._ready_future is not None:
            raise EngineError("this engine has been started already")
        config = self.config
        config.validate()
        loop = asyncio.get_running_loop()
        self._ready_future = loop.create_future()
        source, info = await asyncio.to_thread(_read_model_files, config.model)
        self._source, self._info = source, info
        if config.mmproj is not None:  # checked before the worker loads anything
            self._mmproj = await asyncio.to_thread(_read_mmproj, config.mmproj, source, info)
        _check_tensor_parallel(config.tp_size, info)
        self._context_length = config.max_model_len or info.context_length
        self._addresses = addresses = RingAddresses.create()
        atexit.register(self._kill_at_exit)
        try:
            # The worker starts loading the model while the tokenizer loads here.
            self._spawn_worker(source.path, config.num_kv_blocks(info))
            tokenizer = await asyncio.to_thread(model_files.load_tokenizer, source)
            self._tokenizers = TokenizerManager(
                tokenizer,
                workers=config.tokenizer_workers,
                context_length=self._context_length,
                vocab_size=info.vocab_size,
            )
            # The detokenizer decodes with exactly this tokenizer, saved where only we can read.
            tokenizer_file = os.path.join(addresses.directory, "tokenizer.json")
            await asyncio.to_thread(tokenizer.backend_tokenizer.save, tokenizer_file)
            if self._mmproj is not None:
                self._tokenizers.images = await asyncio.to_thread(
                    ImagePrompts.from_mmproj, self._mmproj, tokenizer
                )
            else:
                self._tokenizers.images = await asyncio.to_thread(
                    ImagePrompts.load, source.path, tokenizer
                )
            self._embedding = embeddings.describe(
                path=source.path,
                kind=source.kind,
                name=self.model_name,
                hidden_size=info.hidden_size,
                tokenizer=tokenizer,
                pooling=config.pooling,
                normalize=config.embedding_normalize,
                rerank_mode=config.rerank_mode,
            )
            self._spawn_detokenizer(tokenizer_file)
            self._scheduler = SchedulerLoop(
                addresses=addresses,
                children=self._children,
                make_planner=self._make_planner,
                loop=loop,
                sink=self,
                ready_timeout=config.ready_timeout,
                shutdown_timeout=config.shutdown_timeout,
                step_timeout=config.step_timeout,
                speculative=config.speculative_algorithm is not None,
            )
            self._scheduler.start()
            self._ready = await self._ready_future
        except BaseException:
            await self._teardown()
            raise
        log.info(
            "engine ready: %s (%s) in %s on %s (backend %s: %s), KV pool %d blocks × %d tokens "
            "(%s), quantization %s, model loaded in %.1f s",
            self.model_name,
            self._ready.architecture,
            self._ready.dtype,
            self._ready.device,
            self._ready.backend,
            self._ready.backend_reason,
            self._ready.num_blocks,
            self._ready.block_size,
            self._ready.kv_cache_dtype,
            self._ready.quantization,
            self._ready.load_seconds,
        )
        return self

    def _spawn_detokenizer(self, tokenizer_file: str) -> None:
        config, addresses = self.config, self._addresses
        assert addresses is not None
        self._children.start(
            "detokenizer",
            "pyserve.detokenizer",
            DetokenizerConfig(
                tokenizer_file=tokenizer_file,
                in_addr=addresses.detok_in,
                out_addr=addresses.main_in,
                parent_pid=os.getpid(),
                log_level=config.log_level,
                ring_dir=addresses.directory,
            ),
        )

    def _spawn_worker(self, model_path: str, num_blocks: int) -> None:
        """The worker: one process, or one per tensor-parallel rank (rank 0 on the ring)."""
        config, addresses = self.config, self._addresses
        assert addresses is not None
        size = config.tp_size
        # rank 0 hosts torch.distributed's store on a free loopback port
        tp_init = f"tcp://127.0.0.1:{free_port()}" if size > 1 else ""
        for rank in range(size):
            self._children.start(
                "worker" if size == 1 else f"worker rank {rank}",
                "pyserve.worker",
                WorkerConfig(
                    in_addr=addresses.worker_in,
                    out_addr=addresses.detok_in,
                    settings=config.worker_settings(model_path, num_blocks),
                    parent_pid=os.getpid(),
                    log_level=config.log_level,
                    torch_threads=config.torch_threads,
                    tp_rank=rank,
                    tp_size=size,
                    tp_init=tp_init,
                ),
                # rank 0 may have been started with the command, its imports done by now
                early_worker.take() if rank == 0 else None,
            )

    def _make_planner(self, ready: Ready) -> Any:  # runs on the scheduler thread
        from pyserve import _core

        config = self.config
        assert self._info is not None
        max_prefill_tokens, chunked_prefill_size = config.resolved_prefill_budget()
        planner = _core.Planner(
            ready.num_blocks,
            ready.block_size,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            policy=config.schedule_policy,
            enable_radix_cache=config.enable_radix_cache,
            # a vision model's image positions hold ids above the vocabulary (image_prompts.py)
            vocab_size=self._info.vocab_size if not self.takes_images else MAX_TOKEN_ID,
            disk_budget_blocks=self._disk_budget_blocks(ready),
            tenant_fairness=config.fairness == "tenant",
            fairness_quantum=config.fairness_quantum,
            **config.planner_speculation(),
        )
        if ready.disk_tier and ready.disk_index:
            restore_disk_tier(planner, ready.disk_index, ready.block_size)
        idle_check.apply_test_hook(planner)
        return planner

    def _disk_budget_blocks(self, ready: Ready) -> int:
        """The disk tier's size in blocks: 0 unless the worker holds a tier (it runs without
        one when other servers hold the directories). Under --tp a block's bytes are every
        rank's shards together: --disk-cache-gib is the server's."""
        if not ready.disk_tier or ready.disk_block_bytes <= 0:
            return 0
        return self.config.disk_cache_bytes // ready.disk_block_bytes

    async def shutdown(self) -> None:
        """Stops the ring cleanly (Shutdown → worker → detokenizer → Stopped), waits for the
        children to exit (killing any that do not), and removes the IPC directory."""
        if self._closed:
            return
        self._closing = True
        self._registry.fail(None, EngineError("the engine is shutting down"))
        await self._teardown()

    async def _teardown(self) -> None:
        timeout = self.config.shutdown_timeout
        if self._scheduler is not None:
            self._scheduler.stop()
            await asyncio.to_thread(self._scheduler.join, timeout + 2)
        # After a clean stop the children exit by themselves; otherwise there is no point waiting.
        clean = self._scheduler is not None and self._scheduler.stopped_cleanly
        if clean and not await asyncio.to_thread(self._children.wait, timeout):
            log.warning("a child process did not exit after the ring stopped; killing it")
        await asyncio.to_thread(self._children.kill)
        if self._scheduler is not None:
            self._scheduler.close()
        if self._tokenizers is not None:
            self._tokenizers.close()
        if self._addresses is not None:
            self._addresses.remove()
        atexit.unregister(self._kill_at_exit)
        self._closed = True
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.cancel()

    def _kill_at_exit(self) -> None:
        """The interpreter is exiting without shutdown(): leave no children and no files."""
        self._children.kill(grace=1.0)
        if self._addresses is not None:
            self._addresses.remove()

    async def __aenter__(self) -> Engine:
        if self._ready_future is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ------------------------------------------------------------------ SchedulerLoop's sink

    def on_ready(self, ready: Ready) -> None:
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_result(ready)

    def on_step(self, deltas: list[tuple[RequestDelta, int | None, int | None]]) -> None:
        self._registry.on_step(deltas)

    def on_request_error(self, rids: list[int] | None, error: Exception) -> None:
        self._registry.fail(rids, error)

    def on_fatal(self, error: Exception) -> None:
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_exception(error)
            return
        if self._closing:
            return
        self._failure = error
        self._failed.set()
        self._registry.fail(None, error)

    def on_idle(self, problems: list[str], last_submitted_rid: int) -> None:
        """The idle self-check's verdict (see idle_check.py), completed with the request states
        that live here on the event loop."""
        problems = problems + idle_check.unfinished_states(
            self._registry.by_core_rid.values(), last_submitted_rid
        )
        self._idle_checks += 1
        if problems:
            self._idle_check_failures += 1
            log.error("idle accounting check failed: %s", "; ".join(problems))
        else:
            log.debug("idle accounting check passed")

    def on_stall(self, stall: Stall | None) -> None:
        """The step watchdog's verdict changed (see step_watch.py; it has logged why)."""
        self._stall = stall

    # ------------------------------------------------------------------ state

    @property
    def ready(self) -> bool:
        return self._ready is not None and not self._closed

    @property
    def serving(self) -> bool:
        """Takes new requests: ready, not failed, not shutting down (a stalled step does not
        stop it: a worker that is only slow still finishes them)."""
        return self.ready and self._failure is None and not self._closing

    @property
    def healthy(self) -> bool:
        """What /health says: serving, and no step stuck in the worker past the step timeout."""
        return self.ready and self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """Why a ready engine is not healthy, in words; None when it is (or is not ready)."""
        if not self.ready:
            return None
        if self._failure is not None:
            return f"the engine has failed: {self._failure}"
        if self._closing:
            return "the engine is shutting down"
        if self._stall is not None:
            return f"the worker is stalled: {self._stall.describe(time.monotonic())}"
        return None

    @property
    def failure(self) -> BaseException | None:
        """Why the engine died (a subprocess exited, the scheduler loop failed), or None."""
        return self._failure

    async def wait_failed(self) -> BaseException:
        """Returns once the engine has died; for servers that exit when it does."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self._source.name if self._source is not None else ""

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def num_blocks(self) -> int:
        return self._ready.num_blocks if self._ready is not None else 0

    @property
    def block_size(self) -> int:
        return self._ready.block_size if self._ready is not None else self.config.block_size

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (for token texts); None before start."""
        return self._tokenizers.tokenizer if self._tokenizers is not None else None

    @property
    def model_info(self) -> model_files.ModelInfo | None:
        return self._info

    def stats(self) -> dict:
        """The core's latest numbers (refreshed every 0.1 s) plus the engine's own."""
        snapshot = self._snapshot()
        return {
            **snapshot,
            "core_requests": snapshot.get("num_requests", 0),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_requests": len(self._registry),  # request states here, on the event loop
            "idle_checks": self._idle_checks,
            "idle_check_failures": self._idle_check_failures,
            "ready": self.ready,
            "healthy": self.healthy,
            "worker_stalled": self._stall is not None,
            "tenants": self.tenant_stats(),
        }

    def tenant_stats(self, limit: int = TOP_TENANTS) -> dict | None:
        """Under ``fairness="tenant"``: ``active``, the tenants with a request in the engine;
        ``tracked``, the named tenants the table holds (at most ``capacity``); ``top``, the
        ``limit`` tenants of the largest counts, largest first, each with its ``name`` (None:
        the anonymous tenant), ``tokens`` (the planner's count: the prompt and output positions
        planned for its requests, raised to the least-served live tenant's count when it comes
        back from idle) and ``requests`` (in the engine now); ``quantum`` and ``preempted``, the
        running requests retracted to give a less-served tenant a slot. None without fairness."""
        if self.config.fairness != "tenant":
            return None
        tenants = self._tenants
        counts = self._tenant_tokens()
        top = heapq.nlargest(limit, counts.items(), key=lambda item: item[1])
        return {
            "active": tenants.active,
            "tracked": len(tenants),
            "capacity": tenants.capacity,
            "quantum": self.config.fairness_quantum,
            "preempted": self._snapshot().get("fairness_retractions", 0),
            "top": [
                {"name": tenants.name(t), "tokens": n, "requests": tenants.live_requests(t)}
                for t, n in top
            ],
        }

    def _tenant_tokens(self) -> dict[int, int]:
        """The planner's tokens by tenant id, as of its latest snapshot."""
        return self._snapshot().get("tenant_tokens", {})

    def _snapshot(self) -> dict:
        """The planner's latest numbers (refreshed by the scheduler thread); {} before it runs."""
        return self._scheduler.snapshot if self._scheduler is not None else {}

    async def core_stats(self) -> dict:
        """The core's numbers read now (on the scheduler thread), for exact accounting checks."""
        return await self._on_scheduler(lambda planner: planner.stats())

    def server_info(self) -> dict:
        ready = self._ready
        info = dataclasses.asdict(self._info) if self._info is not None else {}
        return {
            "model": self.model_name,
            "model_path": self._source.path if self._source is not None else None,
            "model_info": info,
            "context_length": self.context_length,
            "config": dataclasses.asdict(self.config),
            "dtype": ready.dtype if ready is not None else None,  # what the model computes in
            "kv_cache": {
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "tokens": self.num_blocks * self.block_size,
                "bytes": ready.kv_cache_bytes if ready is not None else 0,
                "dtype": ready.kv_cache_dtype if ready is not None else None,
                "device": ready.device if ready is not None else None,
            },
            # what the worker runs its linear layers in (config.quantization may say auto)
            "quantization": ready.quantization if ready is not None else None,
            # the family that runs, what it computes, and what computes it (backend, kernels)
            "architecture": ready.architecture if ready is not None else None,
            "model_features": ready.features if ready is not None else [],
            "backend": {
                "name": ready.backend if ready is not None else None,
                "reason": ready.backend_reason if ready is not None else None,
                "kernels": ready.kernels if ready is not None else {},
            },
            "prefill_budget": dict(
                zip(
                    ("max_prefill_tokens", "chunked_prefill_size"),
                    self.config.resolved_prefill_budget(),
                    strict=True,
                )
            ),
            "load_seconds": ready.load_seconds if ready is not None else None,
            # bytes of weights a decode step reads, as loaded (packed), embeddings aside
            "weight_bytes": ready.weight_bytes if ready is not None else None,
            "tp_size": ready.tp_size if ready is not None else self.config.tp_size,
            "disk_cache": self._disk_cache_info(),
            "speculative": self._speculative_info(),
            # how admission shares the server: "none" (the schedule policy alone) or "tenant"
            "fairness": self.config.fairness,
            "capabilities": self.capabilities,
            "embedding": self._embedding.info() if self._embedding is not None else None,
            "mmproj": self._mmproj_info(),
            "versions": _versions(),
        }

    def _disk_cache_info(self) -> dict:
        """The prefix cache's disk tier: where its files are and its size (0: off)."""
        ready = self._ready
        on = ready is not None and bool(ready.disk_tier)
        snapshot = self._snapshot()
        return {
            "directory": ready.disk_tier if on else None,
            "max_bytes": self.config.disk_cache_bytes if on else 0,
            "block_bytes": ready.disk_block_bytes if on else 0,
            "budget_blocks": snapshot.get("disk_budget", 0),
            "blocks": snapshot.get("disk_blocks", 0),
        }

    def _mmproj_info(self) -> dict | None:
        """The --mmproj file and what it holds; None without one."""
        if self._mmproj is None:
            return None
        return {
            "path": self._mmproj.path,
            "projector_type": self._mmproj.projector,
            "family": self._mmproj.family,
        }

    def _speculative_info(self) -> dict | None:
        """The speculative-decoding settings, and the acceptance so far; None when off."""
        config = self.config
        if config.speculative_algorithm is None:
            return None
        stats = self._snapshot()
        drafted = stats.get("spec_draft_tokens", 0)
        return {
            "algorithm": config.speculative_algorithm,
            "draft_model_path": config.speculative_draft_model_path,
            "num_draft_tokens": config.speculative_num_draft_tokens,
            "ngram_min_match_window_size": config.speculative_ngram_min_match_window_size,
            "ngram_max_match_window_size": config.speculative_ngram_max_match_window_size,
            "ngram_capacity": config.speculative_ngram_capacity,
            "token_budget": config.speculative_token_budget,
            "draft_tokens": drafted,
            "accepted_tokens": stats.get("spec_accepted_tokens", 0),
            "acceptance_rate": stats.get("spec_accepted_tokens", 0) / drafted if drafted else None,
        }

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams,
        detok: DetokParams | None = None,
        rid: str | None = None,
        images: Sequence[ImageInput] = (),
        priority: int = 0,
        timeout: float | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Streams one request's output; the last chunk has ``finish_reason``.

        ``images``: the prompt's images (``apply_chat_template_with_images`` makes the prompt
        and them); their positions in ``prompt`` hold the model's image token. ``priority``:
        lower runs first, under ``schedule_policy="priority"`` only (ValueError otherwise).
        ``tenant``: whose request it is, under ``fairness="tenant"`` only (ValueError otherwise;
        None or "": the one anonymous tenant).
        ``timeout``: seconds from now, queue and generation together (None: the config's
        ``request_timeout``); past it the request is aborted and ends with finish_reason
        "timeout", or raises RequestTimedOut if it produced nothing.

        Raises ValueError (ContextLengthExceeded among them) for a request that cannot run, and
        EngineError when the engine is not serving or fails while the request runs.
        """
        self._check_serving()
        if isinstance(prompt, str):
            prompt_ids = await self._tokenizer_manager().encode(prompt)
        else:
            prompt_ids = list(prompt)
        if sampling.grammar is not None:
            await self.check_grammar(sampling.grammar)
        state = self._submit(
            prompt_ids,
            sampling,
            detok or DetokParams(),
            rid,
            images=images,
            priority=priority,
            tenant=tenant,
        )
        if timeout is None:
            timeout = self.config.request_timeout
        # one timer a request, not one a chunk: the hot path pays nothing for deadlines
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(timeout, self._expire, state, timeout)
        try:
            while True:
                chunk = await state.next_chunk()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self._remove(state)
            if not state.finished or state.error is not None:
                self._scheduler_loop().abort(state.core_rid)  # the consumer went away

    async def chat(
        self,
        messages: list[dict],
        sampling: SamplingParams,
        detok: DetokParams | None = None,
        rid: str | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """``generate`` over the model's chat template applied to ``messages`` (and ``tools``,
        OpenAI tool definitions; the output is not parsed here: ``pyserve.chat.policy`` does)."""
        self._check_serving()
        prompt_ids = await self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        stream = self.generate(
            prompt_ids, sampling, detok, rid, priority=priority, timeout=timeout, tenant=tenant
        )
        async with contextlib.aclosing(stream) as stream:
            async for chunk in stream:
                yield chunk

    def stream_directly(self, rid: str, sink: Callable[[GenerationChunk], bool] | None) -> bool:
        """Lets ``sink`` take request ``rid``'s mid-stream chunks as the step that makes them
        lands, while its ``generate`` consumer is parked with nothing queued; the sink returns
        False to pass a chunk on to the consumer instead. Final chunks and errors always go to
        the consumer. None removes the sink. False if no such request runs."""
        state = self._registry.get(rid)
        if state is None:
            return False
        state.direct = sink
        return True

    def abort(self, rid: str) -> bool:
        """Ends request ``rid`` with finish_reason "abort"; False if no such request runs."""
        state = self._registry.get(rid)
        if state is None:
            return False
        self._remove(state)
        self._scheduler_loop().abort(state.core_rid)
        state.end_aborted()
        return True

    def _expire(self, state: RequestState, timeout: float) -> None:
        """A request's deadline passed: aborted like ``abort`` (its blocks come back)."""
        if state.finished:
            return
        self._remove(state)
        self._scheduler_loop().abort(state.core_rid)
        state.end_timed_out(timeout)

    def _remove(self, state: RequestState) -> None:
        """Takes ``state`` out of the registry, and its request out of its tenant's count."""
        self._registry.remove(state)
        tenant = self._tenant_of.pop(state.core_rid, None)
        if tenant is not None:
            self._tenants.release(tenant)

    def _submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        detok: DetokParams,
        rid: str | None,
        pooling: Pooling | None = None,
        images: Sequence[ImageInput] = (),
        priority: int = 0,
        tenant: str | None = None,
    ) -> RequestState:
        self._check_serving()
        sampling = check_sampling(sampling)
        if priority and self.config.schedule_policy != "priority":
            raise ValueError("a priority needs schedule_policy='priority'")
        fair = self.config.fairness == "tenant"
        if tenant and not fair:
            raise ValueError("a tenant needs fairness='tenant'")
        if tenant and len(tenant) > MAX_NAME_CHARS:
            raise ValueError(f"a tenant name has at most {MAX_NAME_CHARS} characters")
        if images and not self.takes_images:
            raise ValueError("this model takes no images")
        tokenizers = self._tokenizer_manager()
        if pooling is None:
            tokenizers.check_prompt(prompt_ids, sampling.max_new_tokens)
        else:  # its one sampled token is never computed: the prompt may fill the context
            if not prompt_ids:
                raise embeddings.InvalidEmbedding("the input is empty", "input")
            tokenizers.check_token_ids(prompt_ids)
            if len(prompt_ids) > self.context_length:
                raise embeddings.InputTooLong(len(prompt_ids), self.context_length)
        tokenizers.check_logit_bias(sampling.logit_bias)
        capacity = self.num_blocks * self.block_size
        if len(prompt_ids) + sampling.max_new_tokens > capacity:
            raise KVCacheTooSmall(
                f"the request needs {len(prompt_ids) + sampling.max_new_tokens} tokens of KV "
                f"cache but the whole pool holds {capacity}; reduce the prompt or max_tokens"
            )
        state_class = RequestState if pooling is None else embeddings.PooledRequestState
        state = state_class(
            rid if rid is not None else uuid.uuid4().hex,
            next(self._core_rids),
            len(prompt_ids),
            stream_interval=self.config.stream_interval,
            want_logprobs=sampling.logprobs,
        )
        self._registry.add(state)
        if images:  # checked as the vocabulary's ids above; the core holds the images' own
            prompt_ids = with_image_ids(prompt_ids, images, self._info.vocab_size)
        request = NewRequest(
            rid=state.core_rid,
            prompt_ids=_int32_bytes(prompt_ids),
            sampling=sampling,
            detok=detok,
            pooling=pooling,
            images=list(images),
        )
        tenant_id = ANONYMOUS
        if fair:
            tenant_id = self._tenants.acquire(tenant)
            self._tenant_of[state.core_rid] = tenant_id
        self._scheduler_loop().submit(state.core_rid, request, priority, tenant_id)
        return state

    # ------------------------------------------------------------------ embeddings and rerank

    @property
    def capabilities(self) -> list[str]:
        """What the served model does: every causal LM generates, embeds (its hidden states,
        pooled) and reranks (by a reranker's yes/no logits or by embeddings)."""
        return ["generate", "embed", "rerank"]

    @property
    def embedding_model(self) -> embeddings.EmbeddingModel:
        """How this model embeds and reranks (its default pooling, Matryoshka dimensions, rerank
        mode); available once started."""
        if self._embedding is None:
            raise EngineError("the engine is not started")
        return self._embedding

    async def embed(
        self,
        input: str | Sequence[int],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        rid: str | None = None,
        tenant: str | None = None,
    ) -> Embedding:
        """The embedding of a text or of token ids: the model's final-norm hidden states pooled
        (``pooling``: last, mean or cls; default: the model's), cut to ``dimensions`` where the
        model declares Matryoshka dimensions, and normalized (default: ``--embedding-normalize``).

        An input longer than the context is a ValueError (ContextLengthExceeded), unless
        ``truncate_prompt_tokens`` keeps its last that many tokens (-1: the context's worth).
        It runs through the scheduler as a prefill-only request, batched with everything else
        (``tenant``: whose request it is, as in ``generate``).
        """
        self._check_serving()
        model = self.embedding_model
        model.check_dimensions(dimensions)
        kind = pooling or model.pooling
        if kind not in embeddings.POOLINGS:
            raise embeddings.InvalidEmbedding(
                f"pooling must be one of {', '.join(embeddings.POOLINGS)}; got {kind!r}", "pooling"
            )
        if isinstance(input, str):
            prompt_ids = await self._tokenizer_manager().encode(input)
        else:
            prompt_ids = list(input)
        prompt_ids = self._truncated(prompt_ids, truncate_prompt_tokens)
        raw, chunk = await self._pool(prompt_ids, Pooling(kind=kind), rid, tenant)
        vector = embeddings.finish_vector(
            raw, dimensions, model.normalize if normalize is None else normalize
        )
        return Embedding(
            embedding=vector, prompt_tokens=len(prompt_ids), cached_tokens=chunk.cached_tokens
        )

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> RerankResult:
        """The relevance of each document to ``query``, in the documents' order: P("yes") under
        a Qwen3-Reranker-style model's prompt (``instruction`` goes in it), or the cosine
        similarity of embeddings (``embedding_model.rerank_mode`` says which)."""
        self._check_serving()
        model = self.embedding_model
        if model.rerank_mode == "yes-no":
            assert model.yes_no_ids is not None
            tokens = self._tokenizer_manager()
            prefix = await tokens.encode(embeddings.YES_NO_PREFIX, False)
            suffix = await tokens.encode(embeddings.YES_NO_SUFFIX, False)
            prompts = []
            for document in documents:
                text = embeddings.yes_no_text(query, document, instruction)
                body = await tokens.encode(text, False)
                if truncate_prompt_tokens is not None:  # the pair is cut, never the format
                    body = self._truncated(body, truncate_prompt_tokens)
                prompts.append(prefix + body + suffix)
            pooling = Pooling(kind="logits", token_ids=list(model.yes_no_ids))
            results = await embeddings.gather_all([self._pool(p, pooling, None) for p in prompts])
            scores = [embeddings.yes_probability(raw) for raw, _ in results]
            return RerankResult(scores=scores, prompt_tokens=sum(map(len, prompts)))
        embedded = await embeddings.gather_all(
            [
                self.embed(text, normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
                for text in (query, *documents)
            ]
        )
        first, rest = embedded[0], embedded[1:]
        return RerankResult(
            scores=[embeddings.cosine(first.embedding, e.embedding) for e in rest],
            prompt_tokens=sum(e.prompt_tokens for e in embedded),
        )

    def _truncated(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """The last ``keep`` tokens (vLLM's truncate_prompt_tokens; -1: the context's worth)."""
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.context_length
        if keep < 1:
            raise embeddings.InvalidEmbedding(
                f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                "truncate_prompt_tokens",
            )
        if keep > self.context_length:
            raise embeddings.InvalidEmbedding(
                f"truncate_prompt_tokens {keep} is more than the model's context "
                f"({self.context_length})",
                "truncate_prompt_tokens",
            )
        return prompt_ids[-keep:]

    async def _pool(
        self, prompt_ids: list[int], pooling: Pooling, rid: str | None, tenant: str | None = None
    ) -> tuple[bytes, GenerationChunk]:
        """Runs one prefill-only request: (its pooled float32 vector, its last chunk)."""
        state = self._submit(prompt_ids, _POOL_SAMPLING, _POOL_DETOK, rid, pooling, tenant=tenant)
        assert isinstance(state, embeddings.PooledRequestState)
        try:
            chunk = await embeddings.last_chunk(state)
        finally:
            self._remove(state)
            if not state.finished or state.error is not None:
                self._scheduler_loop().abort(state.core_rid)  # the consumer went away
        if not state.pooled:
            raise EngineError(f"the request ended ({chunk.finish_reason}) without its vector")
        return state.pooled, chunk

    def _check_serving(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(f"the engine has failed: {self._failure}")
        if self._closing or self._closed:
            raise EngineError("the engine is shutting down")
        if self._ready is None:
            raise EngineError("the engine is not ready yet")

    def _tokenizer_manager(self) -> TokenizerManager:
        if self._tokenizers is None:
            raise EngineError("the engine is not started")
        return self._tokenizers

    def _scheduler_loop(self) -> SchedulerLoop:
        if self._scheduler is None:
            raise EngineError("the engine is not started")
        return self._scheduler

    async def _on_scheduler(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self._scheduler_loop().call(fn))

    # ------------------------------------------------------------------ tokenizer services

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._tokenizer_manager().encode(text, add_special_tokens)

    async def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return await self._tokenizer_manager().decode(ids, skip_special_tokens)

    async def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        return await self._tokenizer_manager().apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    async def apply_chat_template_with_images(
        self,
        messages: list[dict],
        images: Sequence[PromptImage],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> ImagePrompt:
        """``apply_chat_template`` for messages with image parts (``{"type": "image"}``, one
        per image of ``images``, in order): the prompt and its images for ``generate``."""
        return await self._tokenizer_manager().apply_chat_template_with_images(
            messages,
            images,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    async def prompt_with_images(
        self, text: str, images: Sequence[PromptImage], add_special_tokens: bool = True
    ) -> ImagePrompt:
        """A plain ``text`` prompt holding ``image_marker`` once per image of ``images``, in
        order: expanded and encoded as ``apply_chat_template_with_images`` does after rendering
        (special tokens added as ``tokenize`` adds them), the prompt and images for
        ``generate``."""
        return await self._tokenizer_manager().encode_with_images(text, images, add_special_tokens)

    @property
    def image_marker(self) -> str | None:
        """What stands for one image in a prompt's text (the processor's ``image_token``,
        ``<image>`` for Idefics3); None for a model that takes no images."""
        if self._tokenizers is None:
            return None
        return self._tokenizers.image_marker

    @property
    def tokenizer_pool(self) -> concurrent.futures.Executor:
        """The tokenizer thread pool (the server decodes request images on it too)."""
        return self._tokenizer_manager().executor

    @property
    def takes_images(self) -> bool:
        """Whether the served model reads images (a vision model's Hugging Face directory, or
        a GGUF with ``--mmproj``)."""
        return self._tokenizers is not None and self._tokenizers.images is not None

    async def check_grammar(self, grammar: Grammar, param: str = "grammar") -> None:
        """Raises ValueError (naming ``param``) when ``grammar`` cannot be enforced: a JSON
        schema with features the grammar engine lacks, a regex or grammar that does not parse."""
        await self._tokenizer_manager().check_grammar(grammar, param)

    def chat_template_reads(self, name: str) -> bool:
        """Whether the model's chat template mentions ``name`` (``tools``, ``enable_thinking``)."""
        return self._tokenizer_manager().template_reads(name)

    async def flush_cache(self) -> int:
        """Drops every cached prefix not in use, and the disk tier's blocks (the worker deletes
        their files before its next step's forward pass); returns the RAM blocks released."""
        self._check_serving()
        return await self._on_scheduler(lambda planner: planner.flush_cache())


# A prefill-only request samples one greedy token (its finish), never shown to anyone.
_POOL_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
_POOL_DETOK = DetokParams(skip_special_tokens=True)


def _read_model_files(model: str | None) -> tuple[model_files.ModelSource, model_files.ModelInfo]:
    source = model_files.resolve_model(model)
    return source, model_files.read_model_info(source)


def _read_mmproj(path: str, source: model_files.ModelSource, info: model_files.ModelInfo) -> Mmproj:
    """The --mmproj file, once it is known to fit the text model (MmprojError naming both)."""
    if source.kind != "gguf":
        raise MmprojError(
            f"--mmproj {path} goes with a GGUF text model; --model {source.path} is a Hugging "
            "Face directory, which brings its own vision tower"
        )
    mmproj = read_mmproj(path)
    check_pairing(mmproj, source.path, info.hidden_size, info.architecture)
    return mmproj


def _int32_bytes(ids: list[int]) -> bytes:
    import array

    return array.array("i", ids).tobytes()  # native order: little-endian on every target


def _versions() -> dict[str, str | None]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    import pyserve

    return {
        "pyserve": pyserve.__version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        **{d: version(d) for d in ("torch", "transformers", "tokenizers", "aiohttp", "pyzmq")},
    }


def _check_tensor_parallel(size: int, info: model_files.ModelInfo) -> None:
    """Heads that ``size`` ranks cannot split, refused before any process starts (the worker
    checks the MLP width too, which the model files' summary does not hold)."""
    counts = {"attention heads": info.num_heads, "kv heads": info.num_kv_heads}
    problem = tp_split_problem(size, counts) if size > 1 else None
    if problem is not None:
        raise ValueError(problem)
