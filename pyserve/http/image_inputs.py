"""Reading the image of a chat ``image_url`` part: a reference made into a checked, decoded image.

``read_image(url, param, options, session, executor)`` takes what a client sends as
``{"type": "image_url", "image_url": {"url": ...}}``:

- ``data:image/<type>;base64,<data>``: decoded (bad base64 or a media type that is not an
  image is an error);
- ``http://`` and ``https://`` (unless ``--no-fetch-images``): fetched on the server's shared
  aiohttp session within ``fetch_timeout`` seconds in all, at most ``max_bytes`` read (a larger
  Content-Length is refused before reading), a few redirects, a 2xx status and an ``image/*``
  Content-Type required;
- ``file://`` (only with ``--allowed-media-dir``): a regular file whose real path (symlinks and
  ``..`` resolved) lies under that directory.

The bytes are decoded by Pillow on ``executor`` (never on the event loop): PNG, JPEG, WEBP, GIF
(its first frame) or BMP, at most ``max_pixels`` pixels (checked from the header, before the
pixels are decoded), loaded in full (a truncated or corrupt file is an error, never a partial
image), turned upright by its EXIF orientation and converted to RGB as transformers' image
processors do (``transformers.image_transforms.convert_to_rgb``: transparency composited onto
white), so that the model sees the pixels it would see under transformers.

Every refusal is an :class:`ImageInputError`: a 400 with code ``invalid_image`` naming the part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import os
import re
import stat
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from PIL import Image, ImageOps, UnidentifiedImageError

from pyserve.http.errors import APIError

T = TypeVar("T")

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's limit on one image
DEFAULT_IMAGE_FETCH_TIMEOUT = 10.0  # seconds, for the whole fetch: connect, headers and body
DEFAULT_MAX_IMAGES_PER_REQUEST = 16
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000  # an RGB image this large takes 150 MB decoded
DEFAULT_MAX_REDIRECTS = 5

# What read_image decodes; Pillow tries no other of its plugins.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

_CHUNK = 64 * 1024
_SPACE = re.compile(r"\s")
_USER_AGENT = "pyserve (image fetch)"


class ImageInputError(APIError, ValueError):
    """An image the server cannot take: a 400 with code ``invalid_image``.

    ``param`` is where the part is (``messages[1].content[2].image_url``); ``reason`` says what
    is wrong with it. It is an :class:`APIError`, so the app's error middleware answers it as
    is, and a ValueError, as any other invalid input."""

    def __init__(self, param: str | None, reason: str) -> None:
        where = f" in {param}" if param else ""
        super().__init__(400, f"Invalid image{where}: {reason}", param=param, code="invalid_image")
        self.param = param
        self.reason = reason


@dataclass(frozen=True)
class ImageOptions:
    """Where images may come from and how large they may be (``pyserve run`` flags)."""

    fetch: bool = True  # http(s) URLs are fetched (--no-fetch-images: refused)
    allowed_media_dir: str | None = None  # file:// URLs under it only; None: file:// refused
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # encoded size of one image (--max-image-bytes)
    fetch_timeout: float = DEFAULT_IMAGE_FETCH_TIMEOUT  # seconds (--image-fetch-timeout)
    max_images: int = DEFAULT_MAX_IMAGES_PER_REQUEST  # per request (--max-images-per-request)
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width × height: the decompression-bomb guard
    max_redirects: int = DEFAULT_MAX_REDIRECTS

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"the image byte limit must be positive, not {self.max_bytes}")
        if not self.fetch_timeout > 0:
            raise ValueError(f"the image fetch timeout must be positive, not {self.fetch_timeout}")
        if self.max_images < 0:
            raise ValueError(f"the image count limit cannot be negative ({self.max_images})")
        if self.max_pixels <= 0:
            raise ValueError(f"the image pixel limit must be positive, not {self.max_pixels}")
        if self.max_redirects < 0:
            raise ValueError(f"the redirect limit cannot be negative ({self.max_redirects})")


@dataclass(frozen=True)
class LoadedImage:
    """A decoded RGB image. ``digest`` is the SHA-256 of its size and RGB pixels: the same
    picture hashes the same whatever file format carried it. ``source`` names where it came
    from for logs and errors (the URL; for a data URL only its media type)."""

    image: Image.Image
    digest: bytes
    source: str


def check_image_count(count: int, options: ImageOptions, param: str | None = "messages") -> None:
    """Raises ImageInputError when a request carries more than ``options.max_images`` images."""
    if count > options.max_images:
        raise ImageInputError(
            param,
            f"the request has {count} images; this server takes at most {options.max_images} "
            "per request (--max-images-per-request)",
        )


def new_fetch_session() -> aiohttp.ClientSession:
    """A client session for fetching images (the server shares one: ServerState)."""
    return aiohttp.ClientSession(
        headers={"User-Agent": _USER_AGENT, "Accept": "image/*"},
        connector=aiohttp.TCPConnector(limit=64, limit_per_host=16),
    )


async def read_image(
    url: str,
    param: str | None,
    options: ImageOptions,
    session: aiohttp.ClientSession | None,
    executor: Executor | None,
) -> LoadedImage:
    """The image ``url`` refers to, checked and decoded (on ``executor``); ImageInputError
    naming ``param`` when it cannot be had. ``session`` fetches http(s) URLs (None: a session
    made for this one fetch)."""
    if not isinstance(url, str) or not url:
        raise ImageInputError(param, "the image URL is empty")
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    loop = asyncio.get_running_loop()

    def run(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        return loop.run_in_executor(executor, fn, *args)

    if scheme == "data":
        media_type, payload = _split_data_url(url, param, options)
        source = f"data:{media_type}"
        return await run(_decode_data_url, payload, source, param, options)
    if scheme in ("http", "https"):
        if not options.fetch:
            raise ImageInputError(
                param,
                "this server does not fetch image URLs (--no-fetch-images); "
                "send the image as a base64 data: URL",
            )
        data = await _fetch(url, param, options, session)
        return await run(_decode, data, url, param, options)
    if scheme == "file":
        if options.allowed_media_dir is None:
            raise ImageInputError(
                param, "file:// URLs are not allowed on this server (see --allowed-media-dir)"
            )
        return await run(_read_and_decode_file, url, param, options)
    allowed = ["data:"]
    if options.fetch:
        allowed.append("http(s)://")
    if options.allowed_media_dir is not None:
        allowed.append("file://")
    raise ImageInputError(
        param, f"unsupported image URL (it must start with {' or '.join(allowed)})"
    )


# ---------------------------------------------------------------------------------- data: URLs


def _split_data_url(url: str, param: str | None, options: ImageOptions) -> tuple[str, str]:
    """``data:<media type>[;params];base64,<payload>`` → (media type, payload)."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ImageInputError(param, "a data: URL needs a ',' before its data")
    parts = [p.strip() for p in header.split(";")]
    media_type = parts[0].lower()
    if not media_type.startswith("image/"):
        shown = media_type or "none (text/plain)"
        raise ImageInputError(
            param, f"the data: URL's media type is {shown}, not an image (image/png, image/jpeg…)"
        )
    if "base64" not in (p.lower() for p in parts[1:]):
        raise ImageInputError(param, "an image data: URL must be base64-encoded (';base64,')")
    # Known without decoding: 4 characters carry 3 bytes, and line breaks add up to 1/32.
    if len(payload) > _base64_length(options.max_bytes) * 33 // 32 + 4:
        raise ImageInputError(param, _too_large(options.max_bytes))
    return media_type, payload


def _decode_data_url(
    payload: str, source: str, param: str | None, options: ImageOptions
) -> LoadedImage:
    if _SPACE.search(payload):
        payload = _SPACE.sub("", payload)  # line-wrapped base64 (MIME) is still base64
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(param, f"the data: URL is not valid base64 ({exc})") from None
    if len(data) > options.max_bytes:
        raise ImageInputError(param, _too_large(options.max_bytes))
    return _decode(data, source, param, options)


# ---------------------------------------------------------------------------------- http(s)


async def _fetch(
    url: str, param: str | None, options: ImageOptions, session: aiohttp.ClientSession | None
) -> bytes:
    shown = _shown(url)
    try:
        if session is None:
            async with new_fetch_session() as own:
                return await asyncio.wait_for(_get(own, url, param, options), options.fetch_timeout)
        return await asyncio.wait_for(_get(session, url, param, options), options.fetch_timeout)
    except ImageInputError:
        raise
    except asyncio.TimeoutError:
        raise ImageInputError(
            param, f"fetching {shown} took longer than {options.fetch_timeout:g} s"
        ) from None
    except aiohttp.TooManyRedirects:
        raise ImageInputError(
            param, f"fetching {shown} was redirected more than {options.max_redirects} times"
        ) from None
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a URL yarl cannot parse
        detail = str(exc) or type(exc).__name__
        raise ImageInputError(param, f"could not fetch {shown}: {detail}") from None


async def _get(
    client: aiohttp.ClientSession, url: str, param: str | None, options: ImageOptions
) -> bytes:
    """The body of ``url``; the caller bounds the whole exchange by the fetch timeout."""
    async with client.get(
        url, max_redirects=options.max_redirects, allow_redirects=True
    ) as response:
        if not 200 <= response.status < 300:
            raise ImageInputError(
                param,
                f"fetching {_shown(url)} answered HTTP {response.status} {response.reason or ''}",
            )
        if not response.content_type.lower().startswith("image/"):
            raise ImageInputError(
                param, f"{_shown(url)} is {response.content_type}, not an image (image/*)"
            )
        length = response.content_length
        if length is not None and length > options.max_bytes:
            raise ImageInputError(param, _too_large(options.max_bytes))
        chunks = []
        size = 0
        async for chunk in response.content.iter_chunked(_CHUNK):
            size += len(chunk)
            if size > options.max_bytes:
                raise ImageInputError(param, _too_large(options.max_bytes))
            chunks.append(chunk)
        return b"".join(chunks)


# ---------------------------------------------------------------------------------- file://


def _local_path(url: str, param: str | None, allowed_dir: str) -> str:
    """The real path of a file:// URL, which must lie under ``allowed_dir`` (also resolved)."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageInputError(param, "a file:// URL must name a local file (file:///path)")
    if parts.query or parts.fragment:
        raise ImageInputError(param, "a file:// URL takes no query or fragment")
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise ImageInputError(param, "a file:// URL needs an absolute path")
    root = os.path.realpath(allowed_dir)
    real = os.path.realpath(path)  # every symlink and '..' resolved
    if os.path.commonpath([root, real]) != root or real == root:
        raise ImageInputError(param, "the file is not under the server's allowed media directory")
    return real


def _read_and_decode_file(url: str, param: str | None, options: ImageOptions) -> LoadedImage:
    assert options.allowed_media_dir is not None
    path = _local_path(url, param, options.allowed_media_dir)  # file system calls: not on the loop
    try:
        # O_NOFOLLOW: the checked path cannot have become a symlink since.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise ImageInputError(param, f"no such file: {url}") from None
    except OSError as exc:
        raise ImageInputError(param, f"cannot read {url}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ImageInputError(param, f"{url} is not a regular file")
        if info.st_size > options.max_bytes:
            raise ImageInputError(param, _too_large(options.max_bytes))
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(options.max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > options.max_bytes:
        raise ImageInputError(param, _too_large(options.max_bytes))
    return _decode(data, url, param, options)


# ---------------------------------------------------------------------------------- decoding


def _decode(data: bytes, source: str, param: str | None, options: ImageOptions) -> LoadedImage:
    """Decodes ``data`` in full and converts it to RGB (runs on the executor)."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:
            width, height = opened.size
            if width * height > options.max_pixels:
                raise ImageInputError(param, _too_many_pixels(width, height, options))
            opened.load()  # raises on truncated or corrupt data (LOAD_TRUNCATED_IMAGES unset)
            rgb = to_rgb(ImageOps.exif_transpose(opened))
    except ImageInputError:
        raise
    except Image.DecompressionBombError:
        raise ImageInputError(param, "the image has too many pixels") from None
    except UnidentifiedImageError:
        raise ImageInputError(
            param, f"the data is not an image in a supported format ({', '.join(FORMATS)})"
        ) from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, EOFError, …
        raise ImageInputError(
            param, f"the image could not be decoded ({type(exc).__name__}: {exc})"
        ) from None
    return LoadedImage(image=rgb, digest=pixel_digest(rgb), source=source)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' ``convert_to_rgb`` makes it: an image with transparency (an alpha
    band, or a palette or grayscale with a transparent color) composited onto white."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def pixel_digest(image: Image.Image) -> bytes:
    """SHA-256 of an RGB image's size and pixels."""
    if image.mode != "RGB":
        raise ValueError(f"pixel_digest takes an RGB image, not {image.mode}")
    digest = hashlib.sha256(b"RGB %d %d\n" % image.size)
    digest.update(image.tobytes())
    return digest.digest()


def _shown(url: str) -> str:
    """A URL as error messages show it (a signed URL can be long)."""
    return url if len(url) <= 200 else url[:200] + "…"


def _base64_length(size: int) -> int:
    return (size + 2) // 3 * 4


def _too_large(max_bytes: int) -> str:
    return f"the image is larger than {max_bytes} bytes (--max-image-bytes)"


def _too_many_pixels(width: int, height: int, options: ImageOptions) -> str:
    return (
        f"the image is {width}×{height}, more than the {options.max_pixels} pixels this "
        "server decodes"
    )
