"""The detokenizer subprocess: token ids from the worker in, text deltas to main out.

It PULLs from the worker (``in_addr``, bound here) and PUSHes to main (``out_addr``). One StepDone
goes out for every StepTokens that comes in, carrying that step's rids and tokens untouched (main
reports them to the core) and one RequestDelta per token of a request that is still live (a
verify entry may report several tokens of one request: they are decoded in order, and a stop
string found at one of them ends the request before the next). It never imports
torch: only ``tokenizers``, ``msgspec``, ``zmq`` and numpy.
"""

from __future__ import annotations

import logging
import shutil
import signal
import traceback
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import zmq
from tokenizers import Tokenizer

from pyserve.detokenizer.incremental import (
    PROMPT_CONTEXT_TOKENS,
    IncrementalDecoder,
    decode_step,
)
from pyserve.detokenizer.stop import StopStringMatcher
from pyserve.lifecycle import die_with_parent
from pyserve.wire import detok_to_main as out
from pyserve.wire import worker_to_detok as inp

log = logging.getLogger("pyserve.detokenizer")

_FINISH_REASONS = {
    inp.FINISH_STOP: "stop",
    inp.FINISH_LENGTH: "length",
    inp.FINISH_GRAMMAR: "stop",
    inp.FINISH_GRAMMAR_ERROR: "error",
}


class DetokenizerConfig(msgspec.Struct, forbid_unknown_fields=True):
    tokenizer_file: str  # a tokenizers JSON file (the main process saves its own tokenizer)
    in_addr: str  # ZMQ PULL, bound here; the worker connects its PUSH
    out_addr: str  # ZMQ PUSH, connected to main's PULL
    parent_pid: int = 0  # 0: do not watch the parent
    log_level: str = "info"
    # main's private IPC directory: removed here if main dies before it could remove it itself
    # (a SIGKILL while the model loads), so that no socket or tokenizer file is left behind
    ring_dir: str | None = None


class RequestText:
    """Per-request state: the decoding window and the stop-string matcher, both bounded."""

    __slots__ = ("decoder", "finished", "params", "stop")

    def __init__(self, prompt_ids: bytes, params: inp.DetokParams) -> None:
        prompt = np.frombuffer(prompt_ids, dtype="<i4")[-PROMPT_CONTEXT_TOKENS:].tolist()
        self.decoder = IncrementalDecoder(prompt, params.skip_special_tokens)
        self.stop = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.params = params
        self.finished = False  # by EOS, length or a stop string; later tokens are ignored


class Detokenizer:
    """Turns StepTokens into StepDone; the socket-free part, so that tests can drive it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[int, RequestText] = {}

    def add_request(self, msg: inp.DetokRequest) -> None:
        self.requests[msg.rid] = RequestText(msg.prompt_ids, msg.params)

    def process_step(self, msg: inp.StepTokens) -> out.StepDone:
        rids = np.frombuffer(msg.rids, dtype="<i8").tolist()
        step = _StepView(
            msg,
            rids,
            np.frombuffer(msg.token_ids, dtype="<i4").tolist(),
            np.frombuffer(msg.logprobs, dtype="<f4").tolist() if msg.logprobs else None,
            {t.index: t for t in msg.top_logprobs},
            {p.index: p.values for p in msg.pooled},
        )
        deltas: list[out.RequestDelta] = []
        if len(set(rids)) == len(rids):  # one token a request (no verify entry emitted more)
            self._process_round(step, range(len(rids)), deltas)
        else:
            for entries in _rounds(rids):
                self._process_round(step, entries, deltas)
        self.drop(msg.dropped)
        return out.StepDone(
            step_id=msg.step_id,
            rids=msg.rids,
            token_ids=msg.token_ids,
            deltas=deltas,
            forward_ms=msg.forward_ms,
            computed_tokens=msg.computed_tokens,
            worker_requests=msg.worker_requests,
            detokenizer_requests=len(self.requests),
            worker_busy_seconds=msg.busy_seconds,
            worker_steps=msg.steps,
            failed_loads=msg.failed_loads,
        )

    def _process_round(
        self, step: _StepView, entries: Sequence[int], deltas: list[out.RequestDelta]
    ) -> None:
        """Decodes one token of each request named by ``entries`` (each at most once), and
        appends their deltas. A request finished in an earlier round takes no more text."""
        msg, tokens = step.msg, step.tokens
        live: list[tuple[int, int, RequestText]] = []  # (entry index, rid, state)
        for i in entries:
            rid = step.rids[i]
            state = self.requests.get(rid)
            if state is None or state.finished:
                continue  # dropped, or computed once more after it finished (overlap)
            # The text of an EOS / stop token is not output unless asked for.
            if msg.finish[i] != inp.FINISH_STOP or state.params.include_stop_str_in_output:
                state.decoder.append(tokens[i])
            live.append((i, rid, state))

        texts = decode_step(
            self.tokenizer,
            [state.decoder for _, _, state in live],
            [msg.finish[i] != inp.FINISH_NONE for i, _, _ in live],
        )
        for (i, rid, state), text in zip(live, texts, strict=True):
            delta = out.RequestDelta(rid=rid, text="", token_ids=msg.token_ids[4 * i : 4 * i + 4])
            released, stop = state.stop.feed(text)
            if stop is not None:
                delta.finish_reason, delta.matched_stop = "stop", stop
            elif msg.finish[i] != inp.FINISH_NONE:
                released += state.stop.flush()
                delta.finish_reason = _FINISH_REASONS.get(msg.finish[i], "stop")
                if msg.finish[i] == inp.FINISH_STOP:
                    delta.matched_stop = tokens[i]
                elif msg.finish[i] == inp.FINISH_GRAMMAR_ERROR:
                    delta.error = (
                        f"the request's grammar could not go on at the sampled token {tokens[i]} "
                        "(the worker's log says why)"
                    )
            delta.text = released
            if delta.finish_reason is not None:
                state.finished = True
            if step.logprobs is not None:
                delta.logprob = step.logprobs[i]
            top = step.tops.get(i)
            if top is not None:
                delta.top_logprobs = list(
                    zip(
                        np.frombuffer(top.token_ids, dtype="<i4").tolist(),
                        np.frombuffer(top.logprobs, dtype="<f4").tolist(),
                        strict=True,
                    )
                )
            if i in step.pooled:
                delta.pooled = step.pooled[i]
            deltas.append(delta)

    def drop(self, dropped: bytes) -> None:
        for rid in np.frombuffer(dropped, dtype="<i8").tolist():
            self.requests.pop(rid, None)

    def failed_step(self, msg: inp.StepTokens) -> out.StepDone:
        """The StepDone of a step that could not be decoded: no deltas, but main's step and
        request accounting still goes on."""
        self.drop(msg.dropped)
        return out.StepDone(
            msg.step_id,
            msg.rids,
            msg.token_ids,
            worker_requests=msg.worker_requests,
            detokenizer_requests=len(self.requests),
            worker_busy_seconds=msg.busy_seconds,
            worker_steps=msg.steps,
            failed_loads=msg.failed_loads,
        )


class _StepView(NamedTuple):
    """One StepTokens' arrays, unpacked once."""

    msg: inp.StepTokens
    rids: list[int]
    tokens: list[int]
    logprobs: list[float] | None
    tops: dict[int, inp.TopLogprobs]
    pooled: dict[int, bytes]


def _rounds(rids: list[int]) -> list[list[int]]:
    """Entry indices grouped by occurrence: round ``j`` holds the ``j``-th entry of each rid
    (a verify entry reports its tokens as consecutive entries of one rid), in entry order, so
    that each round decodes one token a request, exactly as steps of one token each would."""
    rounds: list[list[int]] = []
    seen: dict[int, int] = {}
    for i, rid in enumerate(rids):
        j = seen.get(rid, 0)
        seen[rid] = j + 1
        if j == len(rounds):
            rounds.append([])
        rounds[j].append(i)
    return rounds


def run(config: DetokenizerConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s detokenizer: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    if config.parent_pid:
        ring_dir = config.ring_dir
        cleanup = (lambda: shutil.rmtree(ring_dir, ignore_errors=True)) if ring_dir else None
        die_with_parent(config.parent_pid, cleanup=cleanup)
    detok = Detokenizer(Tokenizer.from_file(config.tokenizer_file))

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(config.in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(config.out_addr)
    log.debug("listening on %s, sending to %s", config.in_addr, config.out_addr)
    try:
        _serve(detok, pull, push)
    finally:
        pull.close(linger=0)
        push.close(linger=2000)  # let Stopped (or a last error) reach main
        ctx.term()


def _serve(detok: Detokenizer, pull: zmq.Socket, push: zmq.Socket) -> None:
    send = push.send
    encode = out.encoder.encode
    decode = inp.decoder.decode
    while True:
        msg = decode(pull.recv())
        if isinstance(msg, inp.StepTokens):
            try:
                send(encode(detok.process_step(msg)))
            except Exception:
                log.error("step %d failed:\n%s", msg.step_id, traceback.format_exc())
                # Keep main's accounting going, and fail the requests of this step.
                send(encode(detok.failed_step(msg)))
                send(encode(out.WorkerError("detokenizer failed on this step", msg.rids)))
        elif isinstance(msg, inp.DetokRequest):
            detok.add_request(msg)
        elif isinstance(msg, inp.WorkerReady):
            send(encode(out.Ready(**msgspec.structs.asdict(msg))))
        elif isinstance(msg, inp.WorkerError):
            send(encode(out.WorkerError(msg.message, msg.rids)))
        elif isinstance(msg, inp.Shutdown):
            send(encode(out.Stopped()))
            return
