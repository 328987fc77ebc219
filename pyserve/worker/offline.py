"""OfflineEngine: the C++ planner and the worker in one process, no HTTP, no ZMQ.

It runs the same loop as the serving pipeline (plan → run → report → finish) with the same
objects (``pyserve._core.Planner``, the wire ``Step``, ``StepExecutor``), minus the sockets and
the detokenizer. With ``overlap`` it plans and runs Step N+1 before reporting Step N, as the
scheduler loop does when it runs ahead of the worker. Used by the tests and the offline
benchmark.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from pyserve.wire.main_to_worker import (
    NewRequest,
    SamplingParams,
    check_sampling,
    step_from_plan,
)
from pyserve.wire.worker_to_detok import (
    FINISH_GRAMMAR_ERROR,
    FINISH_LENGTH,
    FINISH_NONE,
    StepTokens,
)
from pyserve.worker.executor import Runner, StepExecutor
from pyserve.worker.settings import WorkerSettings

# anything else non-zero is "stop"; "error": the request's grammar could not go on
_FINISH_REASONS = {FINISH_LENGTH: "length", FINISH_GRAMMAR_ERROR: "error"}


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    logprobs: list[float] | None = None  # of each sampled token, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, best first
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OfflineEngine:
    """Generates for batches of token-id prompts.

    ``runner`` may be given (any object with ``forward(ForwardBatch)`` and a ``config`` with
    ``vocab_size`` and ``eos_token_ids``); otherwise a ModelRunner is loaded from ``model``.
    ``num_blocks`` sizes the KV pool: make it small (and ``init_reserve_ratio``, one of the
    ``planner_options`` passed on to the Planner, low) to force retraction. The prefix cache
    lives as long as the engine, across ``generate`` calls. ``draft_model`` (a path like
    ``model``) loads a draft model beside the model, for worker-drafted verify entries.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        runner: Runner | None = None,
        draft_model: str | None = None,
        settings: WorkerSettings | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        quantization: str = "none",
        kv_cache_dtype: str | None = None,
        activation_bits: int = 16,
        backend: str = "auto",
        num_blocks: int = 1024,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_running_requests: int = 256,
        max_prefill_tokens: int = 8192,
        chunked_prefill_size: int = 2048,
        policy: str = "fcfs",
        enable_radix_cache: bool = True,
        overlap: bool = True,
        seed: int | None = None,
        check_invariants: bool = False,
        **planner_options: float,
    ) -> None:
        from pyserve._core import Planner

        if settings is None:
            settings = WorkerSettings(
                model=model,
                num_blocks=num_blocks,
                block_size=block_size,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
                quantization=quantization,
                activation_bits=activation_bits,
                device=device,
                backend=backend,
                max_model_len=max_model_len,
                seed=seed,
                draft_model=draft_model,
            )
        elif draft_model is not None:
            settings = msgspec.structs.replace(settings, draft_model=draft_model)
        num_blocks, block_size, device = settings.num_blocks, settings.block_size, settings.device
        if runner is None:
            from pyserve.worker.model_runner import ModelRunner

            runner = ModelRunner(settings)
        self.runner = runner
        config = runner.config
        drafter = None
        if settings.draft_model is not None:
            from pyserve.worker.draft_model import DraftModel, load_draft_runner

            drafter = DraftModel(
                load_draft_runner(settings, runner), device=device, seed=settings.seed
            )
        self.drafter = drafter
        self.executor = StepExecutor(
            runner,
            block_size=block_size,
            eos_token_ids=list(config.eos_token_ids),
            device=device,
            seed=settings.seed,
            drafter=drafter,
            # a ModelRunner's vocabulary and images; a stand-in runner (tests) has neither
            **(runner.executor_options() if hasattr(runner, "executor_options") else {}),
        )
        self.planner = Planner(
            num_blocks,
            block_size,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            policy=policy,
            enable_radix_cache=enable_radix_cache,
            vocab_size=config.vocab_size,
            **planner_options,
        )
        self.overlap = overlap
        self.check_invariants = check_invariants
        self.steps_run = 0
        self._rids = itertools.count()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams] | SamplingParams
    ) -> list[Output]:
        """Runs every prompt to its finish; outputs in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        params = [check_sampling(p) for p in params]  # what the Engine checks on admission
        outputs: dict[int, Output] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = next(self._rids)
                prompt_bytes = np.asarray(prompt, dtype="<i4").tobytes()
                self.planner.add_request(rid, prompt_bytes, p.max_new_tokens)
                outputs[rid] = Output(
                    logprobs=[] if p.logprobs or p.top_logprobs else None,
                    top_logprobs=[] if p.top_logprobs else None,
                )
                self.executor.add_request(NewRequest(rid=rid, prompt_ids=prompt_bytes, sampling=p))
        except Exception:
            for rid in outputs:  # a bad prompt: the ones already added must not linger
                self.planner.abort(rid)
            self.executor.requests.drop(list(outputs))
            raise
        self._run(outputs)
        return list(outputs.values())

    def _run(self, outputs: dict[int, Output]) -> None:
        unfinished = set(outputs)
        in_flight: deque[StepTokens] = deque()
        while unfinished:
            plan = self.planner.plan()
            self._check()
            if plan is None:
                if not in_flight:
                    raise RuntimeError(
                        f"the planner stalled with {len(unfinished)} requests unfinished: "
                        f"{self.planner.stats()}"
                    )
                while in_flight:  # nothing to plan until the results are in
                    self._report(in_flight.popleft(), outputs, unfinished)
                continue
            in_flight.append(self.executor.execute(step_from_plan(plan)))
            self.steps_run += 1
            # with overlap one step stays unreported while the next is planned and run
            while len(in_flight) > (1 if self.overlap else 0):
                self._report(in_flight.popleft(), outputs, unfinished)
        while in_flight:  # steps planned after the last finish still run; their tokens drop
            self._report(in_flight.popleft(), outputs, unfinished)
        # one more plan hands the last finished requests to the worker as ``dropped``
        plan = self.planner.plan()
        if plan is not None:
            self._report(self.executor.execute(step_from_plan(plan)), outputs, unfinished)

    def _report(self, result: StepTokens, outputs: dict[int, Output], unfinished: set[int]) -> None:
        self.planner.report(result.step_id, result.rids, result.token_ids)
        self._check()
        rids = np.frombuffer(result.rids, dtype="<i8").tolist()
        tokens = np.frombuffer(result.token_ids, dtype="<i4").tolist()
        finishes = np.frombuffer(result.finish, dtype=np.uint8).tolist()
        logprobs = np.frombuffer(result.logprobs, dtype="<f4").tolist() if result.logprobs else None
        tops = {t.index: t for t in result.top_logprobs}
        for i, rid in enumerate(rids):
            out = outputs[rid]  # only this call's requests are ever live
            out.token_ids.append(tokens[i])
            if out.logprobs is not None and logprobs is not None:
                out.logprobs.append(logprobs[i])
            if out.top_logprobs is not None and i in tops:
                top = tops[i]
                out.top_logprobs.append(
                    list(
                        zip(
                            np.frombuffer(top.token_ids, dtype="<i4").tolist(),
                            np.frombuffer(top.logprobs, dtype="<f4").tolist(),
                            strict=True,
                        )
                    )
                )
            if finishes[i] != FINISH_NONE:
                out.finish_reason = _FINISH_REASONS.get(finishes[i], "stop")
                out.cached_tokens = int(self.planner.request(rid)["cached_tokens"])
                self.planner.finish(rid)
                unfinished.discard(rid)
                self._check()

    def _check(self) -> None:
        if self.check_invariants:
            self.planner.check_invariants()
