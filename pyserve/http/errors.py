"""The OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` and its helpers.

Handlers raise :class:`APIError`; the error middleware in ``app.py`` turns it (and aiohttp's own
HTTP exceptions: unknown route, wrong method, body too large) into a JSON response with this body.
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web


def json_response(body: object, status: int = 200) -> web.Response:
    """A JSON response serialized by msgspec (anything it cannot encode is written as str)."""
    return web.Response(
        body=msgspec.json.encode(body, enc_hook=str), status=status, content_type="application/json"
    )


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error that reaches the client as an OpenAI error body with HTTP status ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    @property
    def message(self) -> str:
        return self.info.message

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorBody(error=self.info))

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=self.body(),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def not_ready(message: str = "The server is not ready yet.") -> APIError:
    return APIError(503, message, type="service_unavailable", code="server_not_ready")


def server_error(message: str, code: str = "internal_error") -> APIError:
    return APIError(500, message, type="server_error", code=code)


_PATH_IN_MESSAGE = re.compile(r" - at `\$\.?([^`]*)`$")


def from_validation_error(exc: msgspec.ValidationError) -> APIError:
    """A 400 whose ``param`` is the offending field, e.g. ``messages[0].role``."""
    message = str(exc)
    match = _PATH_IN_MESSAGE.search(message)
    param = match.group(1) or None if match else None
    return bad_request(message, param=param, code="invalid_value")


_HTTP_CODES = {
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def from_http_exception(exc: web.HTTPException, request: web.Request) -> APIError:
    """aiohttp's own errors (no route, wrong method, body over the cap) in the OpenAI shape."""
    type_, code = _HTTP_CODES.get(exc.status, ("invalid_request_error", None))
    message = exc.reason
    if exc.status == 404:
        message = f"No route {request.path}."
    elif exc.status == 405:
        message = f"{request.method} is not allowed on {request.path}."
    if exc.status >= 500:
        type_ = "server_error"
    headers = {}
    allow = exc.headers.get("Allow")
    if allow is not None:
        headers["Allow"] = allow
    return APIError(exc.status, message, type=type_, code=code, headers=headers)
