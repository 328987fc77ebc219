"""The images of SGLang's ``/generate`` (``image_data``): one text prompt that holds the
model's image marker (``<image>``) once per image, where each image goes.

``image_data`` is a string or a list of strings, as SGLang takes it: each a URL that
``image_inputs.read_image`` reads (``data:``, ``http(s)://``, ``file://``) or a bare base64
string (SGLang's shorthand for an encoded image file).
"""

from __future__ import annotations

import re

from pyserve.http.chat_images import ImageRef
from pyserve.http.errors import bad_request
from pyserve.http.params import unsupported

# A URL starts with its scheme; base64 has no ':' in its alphabet.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# Pillow finds the format from the bytes; the media type only has to say "an image".
_BARE_BASE64 = "data:image/*;base64,"


def image_refs(image_data: str | list[str]) -> list[ImageRef]:
    """Each image of ``image_data`` as a reference that names its place in the request."""
    if isinstance(image_data, str):
        return [ImageRef(_as_url(image_data), None, "image_data")]
    return [ImageRef(_as_url(s), None, f"image_data[{i}]") for i, s in enumerate(image_data)]


def check_image_prompt(
    marker: str | None, text: object, input_ids: object, images: list[ImageRef]
) -> str:
    """The text prompt that takes ``images``; a 400 where the request cannot give them one
    (a text-only model, token ids, a batch, a marker count that differs)."""
    if marker is None:
        raise unsupported("image_data", "this model takes no images (it serves text only)")
    if input_ids is not None:
        raise bad_request(
            f"image_data needs a text prompt: input_ids cannot say where each image goes "
            f"(send text that holds {marker!r} once per image)",
            param="image_data",
        )
    if isinstance(text, list):
        raise bad_request(
            "image_data goes with a single text prompt, not a batch", param="image_data"
        )
    if not isinstance(text, str):
        raise bad_request(
            f"image_data needs a text prompt that holds {marker!r} once per image", param="text"
        )
    markers = text.count(marker)
    if markers != len(images):
        raise bad_request(
            f"the text holds {markers} image markers ({marker!r}) for {len(images)} images in "
            "image_data: it needs one where each image goes",
            param="text",
        )
    return text


def _as_url(item: str) -> str:
    return item if _SCHEME.match(item) else _BARE_BASE64 + item
