"""Reading a request body under a size cap and decoding it into a request Struct."""

from __future__ import annotations

import contextlib
import logging
from typing import TypeVar

import msgspec
from aiohttp import web

from pyserve.http.errors import APIError, bad_request, from_validation_error

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # ~8M tokens of text: far beyond any context

_decoders: dict[type, msgspec.json.Decoder] = {}
_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])
_known: dict[type, dict[str, type | None]] = {}
_warned: set[str] = set()
_MAX_WARNED = 256  # names; a client sending random keys must not grow this forever
# SGLang fields that sglang-router (pyserve --dp) adds to every request it forwards, at these
# values: what pyserve does anyway, so they pass without a warning; any other value still warns.
ROUTER_DEFAULTS = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}

log = logging.getLogger("pyserve.http")


def too_large(cap: int) -> APIError:
    return APIError(413, f"The request body is larger than {cap} bytes.", code="request_too_large")


async def read_body(request: web.Request, cap: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed ``cap`` bytes.

    The cap is ours, not aiohttp's ``client_max_size``: when pyserve is mounted as a sub-app,
    the parent application's setting would apply instead.
    """
    if request.content_length is not None and request.content_length > cap:
        raise too_large(cap)
    chunks = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > cap:
            raise too_large(cap)
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, type_: type[T]) -> T:
    """A validated request, or a 400 with the OpenAI error body naming what is wrong."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    if not body.strip():
        raise bad_request("The request body is empty; a JSON object is expected.")
    try:
        decoded = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        message = f"The request body is not valid JSON: {exc}"
        raise bad_request(message, code="invalid_json") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.", code="invalid_json") from None
    warn_unknown_fields(body, type_)
    return decoded


def warn_unknown_fields(body: bytes | msgspec.Raw, type_: type, where: str = "") -> None:
    """One WARNING per field name that ``type_`` does not know (other vendors' extensions are
    ignored, as OpenAI ignores them), looking into nested request objects too."""
    known = _known.get(type_)
    if known is None:
        known = _known[type_] = {
            f.encode_name: _struct_or_none(f.type) for f in msgspec.structs.fields(type_)
        }
    try:
        fields = _keys.decode(body)
    except msgspec.DecodeError:
        return
    for name, raw in fields.items():
        if name not in known:
            if not where and _router_default(name, raw):
                continue
            key = f"{type_.__name__}.{name}"
            if key not in _warned and len(_warned) < _MAX_WARNED:
                _warned.add(key)
                log.warning("ignoring the unknown request field %r", f"{where}{name}")
        elif known[name] is not None:
            warn_unknown_fields(raw, known[name], f"{where}{name}.")


def _router_default(name: str, raw: msgspec.Raw) -> bool:
    if name not in ROUTER_DEFAULTS:
        return False
    with contextlib.suppress(msgspec.DecodeError):
        return msgspec.json.decode(raw) is ROUTER_DEFAULTS[name]
    return False


async def read_request(request: web.Request, type_: type[T], cap: int) -> T:
    return decode(await read_body(request, cap), type_)


def _struct_or_none(annotation: object) -> type | None:
    is_struct = isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)
    return annotation if is_struct else None
