"""The image parts of a chat request: where each is (for errors), and the messages as a vision
model's chat template takes them (content parts, ``{"type": "image"}`` where an image goes)."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.http.errors import APIError, bad_request
from pyserve.http.protocol import ChatMessage, ImagePart


@dataclass(frozen=True)
class ImageRef:
    """An image part: its URL, its ``detail`` and the request field it came from."""

    url: str
    detail: str | None
    param: str  # e.g. "messages[1].content[2].image_url"


def template_messages(
    messages: list[ChatMessage], takes_images: bool
) -> tuple[list[dict], list[ImageRef]]:
    """The chat template's messages and the images they hold, in order. A model that takes no
    images renders content as text (an image part is then a 400 naming it)."""
    refs = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                param = f"messages[{i}].content[{j}].image_url"
                if not takes_images:
                    raise _no_images(param)
                url = part.image_url
                if isinstance(url, str):
                    refs.append(ImageRef(url, None, param))
                else:
                    refs.append(ImageRef(url.url, url.detail, param))
    return [m.as_template_input(parts=takes_images) for m in messages], refs


def _no_images(param: str) -> APIError:
    message = f"{param}: this model takes no images (it serves text only)"
    return bad_request(message, param=param, code="unsupported_parameter")
