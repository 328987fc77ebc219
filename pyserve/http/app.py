"""``create_app(engine)``: pyserve's HTTP API as an aiohttp Application.

It serves on its own (``pyserve run``) or mounted inside another aiohttp application::

    parent.add_subapp("/llm", create_app(engine))

The app never starts or stops the engine: whoever created the engine owns it.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from pyserve.http.anthropic_errors import anthropic_errors
from pyserve.http.bodies import DEFAULT_MAX_BODY_BYTES
from pyserve.http.embedding_routes import EmbeddingRoutes
from pyserve.http.errors import APIError, from_http_exception, server_error
from pyserve.http.image_inputs import ImageOptions
from pyserve.http.live_stats import LiveStats
from pyserve.http.messages_routes import MessagesRoutes
from pyserve.http.native_routes import NativeRoutes
from pyserve.http.openai_routes import OpenAIRoutes
from pyserve.http.pipeline import Pipeline
from pyserve.http.responses_routes import ResponsesRoutes
from pyserve.http.responses_store import ResponseStore
from pyserve.http.service_routes import ServiceRoutes
from pyserve.http.state import ServerOptions, ServerState
from pyserve.http.web_ui import WebUI

log = logging.getLogger("pyserve.http")

STATE_KEY = web.AppKey("pyserve_state", ServerState)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queued_requests: int | None = None,
    log_requests: bool = False,
    web_ui: bool = True,
    state_dir: str | None = None,
    responses_store_mb: float = 256,
    images: ImageOptions | None = None,
) -> web.Application:
    """The HTTP API over ``engine`` (a ``pyserve.Engine``, started or still starting); with
    ``web_ui``, also the chat page at ``/`` and the dashboard at ``/dashboard``. Stored
    Responses API responses are kept under ``state_dir`` (None: in memory only), at most
    ``responses_store_mb`` MB of them (0: none). ``images`` says where the images of chat
    requests may come from and how large they may be (None: ImageOptions' defaults)."""
    options = ServerOptions(
        api_key=api_key or None,
        max_body_bytes=max_body_bytes,
        max_queued_requests=max_queued_requests,
        log_requests=log_requests,
        web_ui=web_ui,
        images=images or ImageOptions(),
    )
    state = ServerState(engine, options)
    service = ServiceRoutes(state)
    live = LiveStats(state)
    # Routes that answer while the engine loads, is shutting down or has failed.
    always_open = {service.health, service.server_info, service.metrics, service.openapi}
    always_open.add(live.handle)  # the dashboard shows a server that is loading, too
    always_open.add(service.health_generate)  # it answers 503 with its status itself
    # Probes carry no key: SGLang too leaves /health and /health_generate open.
    no_auth = {service.health, service.health_generate}
    pages = WebUI() if web_ui else None
    if pages is not None:  # the pages ask for the key themselves; the API behind them needs it
        always_open |= pages.handlers
        no_auth |= pages.handlers

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return from_http_exception(exc, request).response()
        except ConnectionError as exc:
            transport = request.transport
            if transport is not None and not transport.is_closing():
                log.exception("unhandled error in %s %s", request.method, request.path)
                return server_error(f"internal error: {type(exc).__name__}").response()
            # The client went away mid-answer. Re-raised, aiohttp would log it as a 500 with a
            # traceback (one per disconnect); a stand-in response instead fails quietly on the
            # closed transport, which aiohttp treats as the premature disconnection it is.
            return web.Response(status=499)
        except Exception as exc:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return server_error(f"internal error: {type(exc).__name__}").response()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            options.api_key is not None
            and request.match_info.handler not in no_auth
            and not _key_matches(request, options.api_key)
        ):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.http_exception is None and (
            request.match_info.handler not in always_open
        ):
            state.check_serving()
        return await handler(request)

    # anthropic_errors answers the Messages routes' errors (auth's too) in Anthropic's shape
    middlewares = [errors, anthropic_errors, auth, gate]
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[STATE_KEY] = state
    pipeline = Pipeline(state)
    OpenAIRoutes(state, pipeline).add_to(app)
    NativeRoutes(state, pipeline).add_to(app)
    responses_store = ResponseStore(state_dir, int(responses_store_mb * (1 << 20)))
    ResponsesRoutes(state, pipeline, responses_store).add_to(app)
    MessagesRoutes(state, pipeline).add_to(app)
    EmbeddingRoutes(state).add_to(app)
    service.add_to(app)
    live.add_to(app)
    if pages is not None:
        pages.add_to(app)

    async def start_probe(_: web.Application) -> None:
        state.metrics.loop_lag.start()
        live.start()

    async def stop_tasks(_: web.Application) -> None:
        await live.stop()
        await state.metrics.loop_lag.stop()
        await state.watcher.close()
        await responses_store.close()
        await state.close_image_session()

    app.on_startup.append(start_probe)
    app.on_cleanup.append(stop_tasks)
    return app


def _key_matches(request: web.Request, key: str) -> bool:
    """OpenAI's clients send the key as ``Authorization: Bearer``, Anthropic's as ``x-api-key``
    (or as a bearer token): either header may carry it."""
    expected = key.encode()
    bearer = request.headers.get("Authorization")
    if bearer is not None and bearer.startswith("Bearer "):
        given = bearer.removeprefix("Bearer ").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, expected):
            return True
    given = request.headers.get("x-api-key")
    return given is not None and hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), expected
    )


class HTTP2PrefaceFilter(logging.Filter):
    """Drops aiohttp's ERROR and traceback for a client that opens with HTTP/2's preface
    (``PRI * HTTP/2.0``): sglang-router probes each worker for gRPC that way before it speaks
    HTTP/1.1, and aiohttp answers it with a 400, which is all it needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc):
            log.debug("answered an HTTP/2 preface (a gRPC probe) with 400")
            return False
        return True


def server_state(app: web.Application) -> ServerState:
    """The shared state of an app made by create_app (servers set ``draining`` through it)."""
    return app[STATE_KEY]
