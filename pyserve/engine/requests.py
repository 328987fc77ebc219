"""Request states on the event loop: rid → the GenerationChunks waiting for its consumer.

The scheduler thread hands over the deltas of a whole step at once; each RequestState turns
its deltas into GenerationChunks (coalescing every ``stream_interval`` tokens) and wakes the
one coroutine that iterates it. Everything here runs on the event loop thread only.

A consumer may also install a direct sink (``RequestState.direct``): a mid-stream chunk is then
offered to it right here, while the consumer is parked with nothing queued, instead of waking
the consumer (at 256 streams, one task wake-up and generator chain per token per stream is most
of the event loop's work). The sink returns False to decline; the chunk then takes the queue.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from pyserve.engine.errors import GrammarBroken, RequestTimedOut
from pyserve.outputs import GenerationChunk, TokenLogprob
from pyserve.wire.detok_to_main import RequestDelta

log = logging.getLogger("pyserve.engine")


def _int32s(data: bytes) -> list[int]:
    # The wire's int32 arrays are little-endian, which is the native order of every platform
    # pyserve runs on; memoryview.cast is the cheapest way to read a handful of them.
    return memoryview(data).cast("i").tolist()


class RequestState:
    __slots__ = (
        "_chunks",
        "_ids",
        "_logprobs",
        "_sent_first",
        "_texts",
        "_waiter",
        "cached_tokens",
        "completion_tokens",
        "core_rid",
        "direct",
        "error",
        "finished",
        "prompt_tokens",
        "rid",
        "spec_accepted_tokens",
        "stream_interval",
        "want_logprobs",
    )

    def __init__(
        self,
        rid: str,
        core_rid: int,
        prompt_tokens: int,
        *,
        stream_interval: int = 1,
        want_logprobs: bool = False,
    ) -> None:
        self.rid = rid
        self.core_rid = core_rid
        self.prompt_tokens = prompt_tokens
        self.stream_interval = stream_interval
        self.want_logprobs = want_logprobs
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.spec_accepted_tokens: int | None = None  # drafts accepted, once it finished
        self.finished = False  # the last chunk is queued (or an error is set)
        self.error: BaseException | None = None
        self._chunks: collections.deque[GenerationChunk] = collections.deque()
        # the consumer's future while it waits for a chunk (a bare future is cheaper per token
        # than an asyncio.Event)
        self._waiter: asyncio.Future | None = None
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._sent_first = False
        # takes a mid-stream chunk instead of the queue while the consumer is parked; True when
        # it took it (the consumer then never sees that chunk)
        self.direct: Callable[[GenerationChunk], bool] | None = None

    def add_delta(
        self, delta: RequestDelta, cached_tokens: int | None, spec_accepted: int | None = None
    ) -> None:
        if self.finished:
            return
        if cached_tokens is not None:
            self.cached_tokens = cached_tokens
        if spec_accepted is not None:
            self.spec_accepted_tokens = spec_accepted
        ids = _int32s(delta.token_ids)
        self._ids.extend(ids)
        self.completion_tokens += len(ids)
        if delta.text:
            self._texts.append(delta.text)
        if self.want_logprobs and delta.logprob is not None:
            top = delta.top_logprobs or []
            self._logprobs.extend(TokenLogprob(t, delta.logprob, top) for t in ids)
        if delta.error is not None:
            if self._ids:
                self._flush(None, None)  # what came before the failure, then the error
            self.fail(GrammarBroken(delta.error))
            return
        if (
            delta.finish_reason is not None
            or not self._sent_first  # the first token goes out at once (time to first token)
            or len(self._ids) >= self.stream_interval
        ):
            self._flush(delta.finish_reason, delta.matched_stop)

    def end_aborted(self) -> None:
        """Queues the last chunk of a request aborted by ``Engine.abort``."""
        if not self.finished:
            self._flush("abort", None)

    def end_timed_out(self, timeout: float) -> None:
        """Its deadline passed: what it produced so far ends with finish_reason "timeout"; with
        nothing produced, the consumer gets RequestTimedOut."""
        if self.finished:
            return
        if self.completion_tokens or self._sent_first:
            self._flush("timeout", None)
        else:
            self.fail(RequestTimedOut(f"the request produced nothing within its {timeout:g} s"))

    def fail(self, error: BaseException) -> None:
        """The consumer gets the chunks already queued, then ``error`` is raised."""
        if not self.finished:
            self.error = error
            self.finished = True
            self._wake()

    async def next_chunk(self) -> GenerationChunk:
        while not self._chunks:
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._chunks.popleft()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _flush(self, finish_reason: str | None, matched_stop: str | int | None) -> None:
        chunk = GenerationChunk(
            rid=self.rid,
            text="".join(self._texts),
            token_ids=self._ids,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            finish_reason=finish_reason,
            matched_stop=matched_stop,
            logprobs=self._logprobs if self.want_logprobs else None,
        )
        self._texts = []
        self._ids = []
        self._logprobs = []
        self._sent_first = True
        if finish_reason is not None:
            self.finished = True
        elif self._offer_direct(chunk):
            return
        self._chunks.append(chunk)
        self._wake()

    def _offer_direct(self, chunk: GenerationChunk) -> bool:
        """Hands ``chunk`` to the direct sink if the consumer has consumed everything before it
        (nothing queued, parked on its waiter), which keeps the stream's order."""
        direct = self.direct
        waiter = self._waiter
        if direct is None or self._chunks or waiter is None or waiter.done():
            return False
        try:
            return direct(chunk)
        except Exception:  # a broken sink must not break the other requests of the step
            log.exception(
                "the direct sink of request %s failed; it streams the usual way", self.rid
            )
            self.direct = None
            return False


class RequestRegistry:
    """The live requests, by the caller's rid and by the core's integer rid."""

    def __init__(self) -> None:
        self.by_rid: dict[str, RequestState] = {}
        self.by_core_rid: dict[int, RequestState] = {}

    def __len__(self) -> int:
        return len(self.by_rid)

    def add(self, state: RequestState) -> None:
        if state.rid in self.by_rid:
            raise ValueError(f"a request with rid {state.rid!r} is already running")
        self.by_rid[state.rid] = state
        self.by_core_rid[state.core_rid] = state

    def remove(self, state: RequestState) -> None:
        if self.by_rid.get(state.rid) is state:
            del self.by_rid[state.rid]
        self.by_core_rid.pop(state.core_rid, None)

    def get(self, rid: str) -> RequestState | None:
        return self.by_rid.get(rid)

    def on_step(self, deltas: list[tuple[RequestDelta, int | None, int | None]]) -> None:
        by_core_rid = self.by_core_rid
        for delta, cached_tokens, spec_accepted in deltas:
            state = by_core_rid.get(delta.rid)
            if state is not None:
                state.add_delta(delta, cached_tokens, spec_accepted)

    def fail(self, core_rids: list[int] | None, error: BaseException) -> None:
        """Fails the named requests, or all of them if ``core_rids`` is None."""
        if core_rids is None:
            targets = list(self.by_core_rid.values())
        else:
            targets = [s for r in core_rids if (s := self.by_core_rid.get(r)) is not None]
        for state in targets:
            state.fail(error)
