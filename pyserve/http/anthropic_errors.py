"""Errors in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, for every
error on the Messages routes: the middleware here sits inside the app's own error middleware
and answers for those paths (validation, auth, the model, the queue, the engine, a route or
method that does not exist there), so an Anthropic client's error classes see what they expect.
"""

from __future__ import annotations

import logging
import re

import msgspec
from aiohttp import web

from pyserve.http.errors import APIError, from_http_exception, server_error

log = logging.getLogger("pyserve.http")

# Anthropic's error types by HTTP status; other 4xx are invalid requests, other 5xx api_error.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# The Messages routes and anything under them, also below a sub-app's prefix.
_MESSAGES_PATH = re.compile(r"/v1/messages(/|$)")


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(error: APIError) -> bytes:
    return msgspec.json.encode(
        {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}
    )


def error_response(error: APIError) -> web.Response:
    return web.Response(
        status=error.status,
        body=error_body(error),
        content_type="application/json",
        headers=error.headers,
    )


def is_messages_path(path: str) -> bool:
    return _MESSAGES_PATH.search(path) is not None


@web.middleware
async def anthropic_errors(request: web.Request, handler) -> web.StreamResponse:
    """Anthropic-shaped errors on the Messages paths; any other path passes through."""
    if not is_messages_path(request.path):
        return await handler(request)
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(from_http_exception(exc, request))
    except ConnectionError:
        raise  # the outer middleware knows what a client that went away needs
    except Exception as exc:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(server_error(f"internal error: {type(exc).__name__}"))
