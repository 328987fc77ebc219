"""Anthropic's image content blocks as the chat route's images (``chat_images.ImageRef``).

``{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}`` becomes a
``data:`` URL; ``{"type": "url", "url": ...}`` is read as a chat ``image_url`` is
(``image_inputs.read_image``). The source is checked here, not by the request's Struct, so that
a text-only server refuses an image block by name whatever its source holds.
"""

from __future__ import annotations

import msgspec

from pyserve.http.anthropic_protocol import ImageBlockParam
from pyserve.http.chat_images import ImageRef
from pyserve.http.errors import APIError, bad_request
from pyserve.http.params import unsupported

# The media types Anthropic documents for a base64 image
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class Base64ImageSource(msgspec.Struct, tag_field="type", tag="base64", kw_only=True):
    media_type: str
    data: str


class URLImageSource(msgspec.Struct, tag_field="type", tag="url", kw_only=True):
    url: str


ImageSource = Base64ImageSource | URLImageSource


def image_ref(block: ImageBlockParam, where: str) -> ImageRef:
    """The image of the block at ``where`` (``messages[0].content[1]``); a 400 naming its
    source when that is not a base64 or url source Anthropic's API would take."""
    param = f"{where}.source"
    raw = block.source
    if isinstance(raw, dict) and raw.get("type") == "file":
        raise unsupported(param, "file sources (the Files API): send the image as base64 or a url")
    try:
        source = msgspec.convert(raw, ImageSource)
    except msgspec.ValidationError as exc:
        raise _bad_source(param, str(exc).replace("`$", f"`{param}")) from None
    if isinstance(source, URLImageSource):
        return ImageRef(source.url, None, param)
    if source.media_type not in MEDIA_TYPES:
        raise _bad_source(
            param, f"media_type {source.media_type!r} is not one of {', '.join(MEDIA_TYPES)}"
        )
    return ImageRef(f"data:{source.media_type};base64,{source.data}", None, param)


def _bad_source(param: str, why: str) -> APIError:
    return bad_request(f"{param}: {why}", param=param, code="invalid_image")
