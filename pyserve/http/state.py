"""What the handlers of one app share: the engine, options, counters and request bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pyserve.engine.errors import (
    ContextLengthExceeded,
    EngineDeadError,
    EngineError,
    GrammarBroken,
    KVCacheTooSmall,
    RequestTimedOut,
)
from pyserve.engine.image_prompts import PromptImage
from pyserve.engine.tenants import MAX_NAME_CHARS
from pyserve.http.bodies import DEFAULT_MAX_BODY_BYTES
from pyserve.http.chat_images import ImageRef
from pyserve.http.disconnect import DisconnectWatcher
from pyserve.http.errors import APIError, bad_request, model_not_found, not_ready, server_error
from pyserve.http.image_inputs import (
    ImageOptions,
    check_image_count,
    new_fetch_session,
    read_image,
)
from pyserve.http.metrics import Metrics
from pyserve.http.token_texts import TokenTexts

log = logging.getLogger("pyserve.http")

T = TypeVar("T")


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # when set, every route but /health needs "Bearer <key>"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_requests: int | None = None  # generation requests waiting for their first token
    log_requests: bool = False  # log prompts and outputs (never logged otherwise)
    web_ui: bool = True  # the chat page at / and the dashboard at /dashboard
    # the images of image_url parts (and Anthropic image blocks): from where, how large
    images: ImageOptions = field(default_factory=ImageOptions)


def engine_error(exc: BaseException) -> APIError:
    """The client-facing error for something the engine raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceeded):
        return bad_request(str(exc), code="context_length_exceeded")
    if isinstance(exc, KVCacheTooSmall):
        return bad_request(str(exc), code="kv_cache_too_small")
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param=getattr(exc, "param", None), code="invalid_value")
    if isinstance(exc, GrammarBroken):
        log.error("request failed: %s", exc)
        return server_error(str(exc), code="grammar_error")
    if isinstance(exc, RequestTimedOut):
        return APIError(503, str(exc), type="service_unavailable", code="request_timeout")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, EngineError):  # not started, or shutting down
        return APIError(503, str(exc), type="service_unavailable", code="engine_unavailable")
    log.exception("request failed", exc_info=exc)
    return server_error(f"internal error: {type(exc).__name__}: {exc}")


async def next_item(stream: AsyncIterator[T]) -> T | None:
    """The stream's next item (None at its end); what the engine raises becomes an APIError."""
    try:
        return await anext(stream, None)
    except Exception as exc:
        raise engine_error(exc) from exc


class QueueTicket:
    """A generation request counted as queued until its first output (or its end)."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._held = True
        state.queued += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self._state.queued -= 1


class ServerState:
    def __init__(self, engine: Any, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.metrics = Metrics(engine)
        self.token_texts = TokenTexts(engine)
        self.watcher = DisconnectWatcher()
        self.draining = False  # set by a server that is shutting down: new requests get 503
        self.in_flight = 0  # generation requests being served
        self.queued = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.active: dict[str, list[str]] = {}  # response id → the engine rids of its choices
        self._model_path: str | None = None
        self._image_session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        """A request may omit the model; a name that is neither the served model's name nor its
        path (what /server_info reports as model_path) is a 404."""
        if model is None or model == self.engine.model_name:
            return
        if model != self.model_path():
            raise model_not_found(model)

    def model_path(self) -> str | None:
        """The served model's file or directory, another name of the model: SGLang names a
        model by its path, and so do sglang-router and SGLang's clients."""
        if self._model_path is None and self.engine.ready:
            self._model_path = self.engine.server_info().get("model_path")  # fixed once loaded
        return self._model_path

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(
                503, "The server is shutting down.", type="service_unavailable", code="draining"
            )
        if not self.engine.ready:
            raise not_ready()
        if not self.engine.serving:  # a stalled step (unhealthy, but serving) takes requests
            if self.engine.failure is None:  # closing: an embedding app is shutting it down
                raise APIError(
                    503, "The engine is shutting down.", type="service_unavailable", code="draining"
                )
            raise APIError(
                503,
                f"The engine has failed: {self.engine.failure}",
                type="server_error",
                code="engine_dead",
            )

    def tenant(self, name: str | None, param: str) -> str | None:
        """The tenant a request names in field ``param`` (its ``user``), under --fairness
        tenant; None without fairness, where the field changes nothing."""
        if not name or self.engine.config.fairness != "tenant":
            return None
        if len(name) > MAX_NAME_CHARS:
            raise bad_request(
                f"{param} names a tenant: at most {MAX_NAME_CHARS} characters, got {len(name)}",
                param=param,
                code="invalid_value",
            )
        return name

    def max_new_tokens(self, prompt_len: int, requested: int | None) -> int:
        """``requested``, or when absent all the room the context and the KV pool leave."""
        if requested is not None:
            return requested
        room = self.engine.context_length
        pool = self.engine.num_blocks * self.engine.block_size
        if pool:
            room = min(room, pool)
        return max(1, room - prompt_len)

    # ------------------------------------------------------------------ images

    def image_session(self) -> aiohttp.ClientSession:
        """The client session that fetches images from http(s) URLs: one for the app, made on
        first use (inside the running loop) and closed with the app."""
        if self._image_session is None or self._image_session.closed:
            self._image_session = new_fetch_session()
        return self._image_session

    async def read_images(
        self, refs: list[ImageRef], count_param: str = "messages"
    ) -> list[PromptImage]:
        """A request's image parts read, checked and decoded (on the tokenizer pool), all at
        once; the first that cannot be had is a 400 naming its part (``count_param``: the
        field that too many images are blamed on)."""
        options = self.options.images
        check_image_count(len(refs), options, count_param)
        session = self.image_session()
        executor = self.engine.tokenizer_pool
        loaded = await asyncio.gather(
            *(read_image(ref.url, ref.param, options, session, executor) for ref in refs)
        )
        return [
            PromptImage(image.image, image.digest, ref.detail)
            for image, ref in zip(loaded, refs, strict=True)
        ]

    async def close_image_session(self) -> None:
        session, self._image_session = self._image_session, None
        if session is not None:
            await session.close()

    # ------------------------------------------------------------------ engine calls

    async def call(self, awaitable: Awaitable[T]) -> T:
        """Awaits an engine coroutine, turning what it raises into an APIError."""
        try:
            return await awaitable
        except (asyncio.CancelledError, APIError):
            raise
        except Exception as exc:
            raise engine_error(exc) from exc

    def admit(self) -> QueueTicket:
        limit = self.options.max_queued_requests
        if limit is not None and self.queued >= limit:
            raise APIError(
                429,
                f"Too many requests are waiting ({self.queued}); retry later.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return QueueTicket(self)

    # ------------------------------------------------------------------ request life

    @contextlib.contextmanager
    def serving(self, request: web.Request, response_id: str, rids: list[str]) -> Iterator[None]:
        """Counts a generation request in flight, aborts it if its client goes away, and lets
        /abort_request find its choices by the response id."""
        self.in_flight += 1
        self._idle.clear()
        self.active[response_id] = rids
        try:
            with self.watcher.watch(request):
                yield
        finally:
            self.active.pop(response_id, None)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no generation request is in flight, False after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort(self, rid: str) -> bool:
        """Aborts an engine rid, or every choice of a response id."""
        rids = self.active.get(rid, [rid])
        aborted = [self.engine.abort(r) for r in rids]
        return any(aborted)
