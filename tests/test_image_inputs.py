"""pyserve/http/image_inputs.py: image_url parts read into checked RGB images, without a model
and without the internet. URLs are served by a local aiohttp server on its own thread (a free
port, stopped at the end of the module); each test reads them on its own event loop."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from pyserve.cli import build_parser, image_options
from pyserve.http.app import create_app, server_state
from pyserve.http.errors import APIError
from pyserve.http.image_inputs import (
    DEFAULT_MAX_IMAGE_BYTES,
    ImageInputError,
    ImageOptions,
    LoadedImage,
    check_image_count,
    read_image,
)

PARAM = "messages[1].content[2].image_url"
LIMIT = 200_000  # bytes, in the options of the fetch tests
FAST = ImageOptions(fetch_timeout=0.5, max_bytes=LIMIT)


# ------------------------------------------------------------------ pictures


def picture(mode: str = "RGB", size: tuple[int, int] = (37, 23), seed: int = 0) -> Image.Image:
    """Noise in ``mode`` (what no codec can smooth over: every pixel matters)."""
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (size[1], size[0], bands), dtype=np.uint8)
    if mode == "RGBA":  # fully transparent, opaque and everything between
        pixels[0, :, 3] = 0
        pixels[1, :, 3] = 255
    if bands == 1:
        return Image.fromarray(pixels[:, :, 0], mode)
    return Image.fromarray(pixels, mode)


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares its size and holds no pixels: what Image.open reads before load()."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


PNG = encode(picture(), "PNG")
JPEG = encode(picture(seed=1), "JPEG", quality=90)


def pixels(loaded: LoadedImage) -> np.ndarray:
    assert loaded.image.mode == "RGB"
    return np.asarray(loaded.image)


# ------------------------------------------------------------------ the local image server


class ImageServer:
    """Serves the pictures and the misbehaviours over http://127.0.0.1:<free port>/."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="image-server", daemon=True)
        self._thread.start()
        assert self._started.wait(10), "the image server did not start"

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _app(self) -> web.Application:
        async def png(_):
            return web.Response(body=PNG, content_type="image/png")

        async def jpeg(_):
            return web.Response(body=JPEG, content_type="image/jpeg")

        async def huge(_):  # a Content-Length over the limit
            return web.Response(body=b"\x89PNG" + bytes(3 * LIMIT), content_type="image/png")

        async def huge_chunked(request):  # no Content-Length: only the bytes read tell
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            try:
                for _ in range(400):  # 400 × 16 KiB, far over the limit
                    await response.write(bytes(16 * 1024))
            except (ConnectionError, asyncio.CancelledError):
                pass  # the client gave up reading, as it should
            return response

        async def slow(_):
            await asyncio.sleep(30)
            return web.Response(body=PNG, content_type="image/png")

        async def slow_body(request):  # the headers come at once, the body never ends
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            await response.prepare(request)
            await response.write(PNG[:20])
            await asyncio.sleep(30)
            return response

        async def html(_):
            return web.Response(text="<html>not an image</html>", content_type="text/html")

        async def octet(_):
            return web.Response(body=PNG, content_type="application/octet-stream")

        async def redirect(request):
            left = int(request.match_info["n"])
            target = "/png" if left == 0 else f"/redirect/{left - 1}"
            raise web.HTTPFound(target)

        async def corrupt(_):
            return web.Response(body=PNG[: len(PNG) // 2], content_type="image/png")

        @web.middleware
        async def count(request, handler):
            self.hits.append(request.path)
            return await handler(request)

        app = web.Application(middlewares=[count])
        app.router.add_get("/png", png)
        app.router.add_get("/jpeg", jpeg)
        app.router.add_get("/huge", huge)
        app.router.add_get("/huge-chunked", huge_chunked)
        app.router.add_get("/slow", slow)
        app.router.add_get("/slow-body", slow_body)
        app.router.add_get("/html", html)
        app.router.add_get("/octet", octet)
        app.router.add_get("/redirect/{n}", redirect)
        app.router.add_get("/corrupt", corrupt)
        return app  # anything else is aiohttp's 404

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._runner = web.AppRunner(self._app(), shutdown_timeout=0.1, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def server():
    image_server = ImageServer()
    yield image_server
    image_server.close()


@pytest.fixture(scope="module")
def executor():
    pool = ThreadPoolExecutor(2, thread_name_prefix="test-images")
    yield pool
    pool.shutdown()


def read(url: str, options: ImageOptions, executor, *, shared_session: bool = True) -> LoadedImage:
    """read_image on a fresh event loop (with a session of its own, as the server's)."""

    async def go() -> LoadedImage:
        if not shared_session:
            return await read_image(url, PARAM, options, None, executor)
        from pyserve.http.image_inputs import new_fetch_session

        async with new_fetch_session() as session:
            return await read_image(url, PARAM, options, session, executor)

    return asyncio.run(go())


def refused(url: str, options: ImageOptions, executor, *words: str) -> ImageInputError:
    with pytest.raises(ImageInputError) as caught:
        read(url, options, executor)
    error = caught.value
    assert error.param == PARAM
    for word in words:
        assert word in str(error), (word, str(error))
    return error


# ------------------------------------------------------------------ the error


def test_the_error_is_a_400_naming_the_part():
    error = ImageInputError(PARAM, "the data is not an image")
    assert isinstance(error, ValueError) and isinstance(error, APIError)
    assert error.status == 400 and error.reason == "the data is not an image"
    body = json.loads(error.response().body)["error"]
    assert body["param"] == PARAM and body["code"] == "invalid_image"
    assert body["type"] == "invalid_request_error"
    assert PARAM in body["message"] and "the data is not an image" in body["message"]


def test_the_image_count_limit():
    options = ImageOptions(max_images=2)
    check_image_count(2, options)
    with pytest.raises(ImageInputError, match="at most 2") as caught:
        check_image_count(3, options)
    assert caught.value.param == "messages"


def test_options_refuse_nonsense():
    with pytest.raises(ValueError):
        ImageOptions(max_bytes=0)
    with pytest.raises(ValueError):
        ImageOptions(fetch_timeout=0)


# ------------------------------------------------------------------ http(s)


def test_fetches_png_and_jpeg(server, executor):
    png = read(server.url("/png"), FAST, executor)
    assert np.array_equal(pixels(png), np.asarray(picture()))
    assert png.source == server.url("/png")
    jpeg = read(server.url("/jpeg"), FAST, executor)
    assert jpeg.image.size == (37, 23)
    assert np.array_equal(pixels(jpeg), np.asarray(Image.open(io.BytesIO(JPEG)).convert("RGB")))


def test_fetches_without_a_shared_session(server, executor):
    loaded = read(server.url("/png"), FAST, executor, shared_session=False)
    assert np.array_equal(pixels(loaded), np.asarray(picture()))


def test_a_body_over_the_limit_is_refused(server, executor):
    refused(server.url("/huge"), FAST, executor, f"larger than {LIMIT} bytes")
    refused(server.url("/huge-chunked"), FAST, executor, f"larger than {LIMIT} bytes")


def test_a_slow_server_times_out(server, executor):
    for path in ("/slow", "/slow-body"):
        started = time.monotonic()
        refused(server.url(path), FAST, executor, "longer than 0.5 s")
        assert time.monotonic() - started < 10  # the server would take 30 s


def test_only_images_are_taken(server, executor):
    refused(server.url("/html"), FAST, executor, "text/html", "not an image")
    refused(server.url("/octet"), FAST, executor, "application/octet-stream")


def test_an_error_status_is_named(server, executor):
    refused(server.url("/missing"), FAST, executor, "HTTP 404")


def test_redirects_are_followed_up_to_the_limit(server, executor):
    loaded = read(server.url("/redirect/3"), FAST, executor)
    assert np.array_equal(pixels(loaded), np.asarray(picture()))
    refused(server.url("/redirect/9"), FAST, executor, "redirected more than 5 times")


def test_a_truncated_png_is_an_error_not_a_partial_image(server, executor):
    refused(server.url("/corrupt"), FAST, executor, "could not be decoded")


def test_nothing_listens(executor):
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    refused(f"http://127.0.0.1:{port}/png", FAST, executor, "could not fetch")


def test_fetching_can_be_turned_off(server, executor):
    before = len(server.hits)
    options = ImageOptions(fetch=False)
    refused(server.url("/png"), options, executor, "--no-fetch-images")
    assert len(server.hits) == before  # not even asked
    assert read(data_url(PNG), options, executor).image.size == (37, 23)  # data: URLs still


def test_unknown_schemes_are_refused(executor):
    refused("ftp://example.com/a.png", FAST, executor, "unsupported image URL")
    refused("a.png", FAST, executor, "unsupported image URL")
    refused("", FAST, executor, "empty")


# ------------------------------------------------------------------ data: URLs


def test_data_urls(executor):
    loaded = read(data_url(PNG), FAST, executor)
    assert np.array_equal(pixels(loaded), np.asarray(picture()))
    assert loaded.source == "data:image/png"
    wrapped = base64.encodebytes(PNG).decode()  # MIME: a line break every 76 characters
    assert read(f"data:image/png;base64,{wrapped}", FAST, executor).digest == loaded.digest


def test_bad_data_urls(executor):
    good = base64.b64encode(PNG).decode()
    refused(f"data:image/png;base64,{good[:-2]}!!", FAST, executor, "not valid base64")
    refused(f"data:image/png;base64,{good[:-1]}", FAST, executor, "not valid base64")
    refused(f"data:text/plain;base64,{good}", FAST, executor, "text/plain", "not an image")
    refused(f"data:;base64,{good}", FAST, executor, "not an image")
    refused(f"data:image/png,{PNG[:8]!r}", FAST, executor, "base64")
    refused("data:image/png;base64", FAST, executor, "','")
    text = base64.b64encode(b"just some text").decode()
    refused(f"data:image/png;base64,{text}", FAST, executor, "not an image in a supported")
    big = data_url(bytes(LIMIT + 1))
    refused(big, FAST, executor, f"larger than {LIMIT} bytes")


def test_only_the_five_formats_are_decoded(executor):
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        loaded = read(data_url(encode(picture(), fmt)), FAST, executor)
        assert loaded.image.size == (37, 23) and loaded.image.mode == "RGB", fmt
    tiff = encode(picture(), "TIFF")
    refused(data_url(tiff, "image/tiff"), FAST, executor, "not an image in a supported format")


def test_a_gif_gives_its_first_frame(executor):
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    loaded = read(data_url(out.getvalue(), "image/gif"), FAST, executor)
    assert pixels(loaded)[0, 0].tolist() == [255, 0, 0]


# ------------------------------------------------------------------ pixels as transformers has them


def test_transparency_is_composited_onto_white_as_transformers_does(executor):
    from transformers.image_transforms import convert_to_rgb

    rgba = picture("RGBA")
    la = picture("LA", seed=2)
    palette = picture("RGB", seed=3).quantize(16)
    palette.info["transparency"] = 5  # one palette entry transparent
    gray = picture("L", seed=4)
    for image, fmt in ((rgba, "PNG"), (rgba, "WEBP"), (la, "PNG"), (palette, "PNG")):
        data = encode(image, fmt, lossless=True) if fmt == "WEBP" else encode(image, fmt)
        expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
        loaded = read(data_url(data, f"image/{fmt.lower()}"), FAST, executor)
        assert np.array_equal(pixels(loaded), expected), (image.mode, fmt)
    gif = encode(palette, "GIF", transparency=5)
    expected = convert_to_rgb(Image.open(io.BytesIO(gif)), return_numpy=True)
    assert np.array_equal(pixels(read(data_url(gif, "image/gif"), FAST, executor)), expected)
    # a transparent pixel is white, an opaque one keeps its color
    opaque = np.asarray(rgba)[1, :, :3]
    loaded = pixels(read(data_url(encode(rgba, "PNG")), FAST, executor))
    assert (loaded[0] == 255).all() and np.array_equal(loaded[1], opaque)
    # without transparency: what transformers' load_image makes of the same data: URL
    from transformers.image_utils import load_image

    for image in (gray, picture(seed=5), picture(seed=7).quantize(16)):
        url = data_url(encode(image, "PNG"))
        assert np.array_equal(pixels(read(url, FAST, executor)), np.asarray(load_image(url)))


def test_exif_orientation_is_applied_as_transformers_does(executor):
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90° clockwise
    url = data_url(encode(picture(seed=6), "JPEG", exif=exif.tobytes()), "image/jpeg")
    loaded = read(url, FAST, executor)
    assert loaded.image.size == (23, 37)
    assert np.array_equal(pixels(loaded), np.asarray(load_image(url)))


def test_the_digest_is_of_the_pixels_not_the_file(executor):
    png = read(data_url(encode(picture(), "PNG")), FAST, executor)
    bmp = read(data_url(encode(picture(), "BMP"), "image/bmp"), FAST, executor)
    webp = read(data_url(encode(picture(), "WEBP", lossless=True), "image/webp"), FAST, executor)
    recompressed = read(data_url(encode(picture(), "PNG", compress_level=0)), FAST, executor)
    assert png.digest == bmp.digest == webp.digest == recompressed.digest
    assert len(png.digest) == 32
    changed = picture()
    r, g, b = changed.getpixel((17, 11))
    changed.putpixel((17, 11), (r ^ 1, g, b))
    assert read(data_url(encode(changed, "PNG")), FAST, executor).digest != png.digest
    # the same bytes in another shape are another image
    flat = Image.frombytes("RGB", (23, 37), picture().tobytes())
    assert read(data_url(encode(flat, "PNG")), FAST, executor).digest != png.digest


def test_the_pixel_limit_is_checked_before_decoding(executor):
    small = ImageOptions(max_pixels=37 * 23)
    assert read(data_url(PNG), small, executor).image.size == (37, 23)
    refused(data_url(PNG), ImageOptions(max_pixels=37 * 23 - 1), executor, "37×23")
    # headers that promise more pixels than the file holds: refused before any is decoded
    refused(data_url(png_header(8000, 8000)), FAST, executor, "8000×8000")
    refused(data_url(png_header(30000, 30000)), FAST, executor, "too many pixels")
    # within the limit, the missing pixels are a decoding error (not a partial image)
    refused(data_url(png_header(100, 100)), FAST, executor, "could not be decoded")


# ------------------------------------------------------------------ file://


@pytest.fixture
def media(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "a b.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "escape.png")
    os.symlink(allowed / "sub" / "a b.png", allowed / "inside.png")
    os.symlink(allowed, tmp_path / "media-link")
    return tmp_path


def test_files_under_the_allowed_dir(media, executor):
    options = ImageOptions(allowed_media_dir=str(media / "media"))
    loaded = read(f"file://{media}/media/sub/a%20b.png", options, executor)
    assert np.array_equal(pixels(loaded), np.asarray(picture()))
    assert read(f"file://{media}/media/inside.png", options, executor).digest == loaded.digest
    assert read(f"file://localhost{media}/media/sub/../sub/a%20b.png", options, executor)
    # the allowed directory named through a symlink
    through_link = ImageOptions(allowed_media_dir=str(media / "media-link"))
    assert read(f"file://{media}/media/sub/a%20b.png", through_link, executor)


def test_files_outside_the_allowed_dir_are_refused(media, executor):
    options = ImageOptions(allowed_media_dir=str(media / "media"))
    outside = "not under the server's allowed media directory"
    refused(f"file://{media}/secret.png", options, executor, outside)
    refused(f"file://{media}/media/../secret.png", options, executor, outside)
    refused(f"file://{media}/media/sub/%2E%2E/%2E%2E/secret.png", options, executor, outside)
    refused(f"file://{media}/media/escape.png", options, executor, outside)
    refused(f"file://{media}/media", options, executor, outside)
    refused(f"file://{media}/media/missing.png", options, executor, "no such file")
    refused(f"file://{media}/media/sub", options, executor, "not a regular file")
    refused(f"file://example.com{media}/media/inside.png", options, executor, "local file")


def test_file_urls_are_refused_without_an_allowed_dir(media, executor):
    refused(f"file://{media}/media/inside.png", FAST, executor, "--allowed-media-dir")


def test_a_file_over_the_limit(media, executor):
    options = ImageOptions(allowed_media_dir=str(media / "media"), max_bytes=len(PNG) - 1)
    refused(f"file://{media}/media/inside.png", options, executor, "larger than")


# ------------------------------------------------------------------ flags and the app


def test_flags_reach_the_app_state():
    parser = build_parser()
    flags = ["--no-fetch-images", "--max-image-bytes", "1000", "--image-fetch-timeout", "2.5"]
    flags += ["--max-images-per-request", "3", "--allowed-media-dir", os.getcwd()]
    args = parser.parse_args(["run", *flags])
    options = image_options(args)
    assert options == ImageOptions(
        fetch=False, allowed_media_dir=os.getcwd(), max_bytes=1000, fetch_timeout=2.5, max_images=3
    )
    defaults = image_options(parser.parse_args(["run"]))
    assert defaults == ImageOptions() and defaults.max_bytes == DEFAULT_MAX_IMAGE_BYTES
    assert defaults.fetch and defaults.allowed_media_dir is None
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--allowed-media-dir", "/no/such/directory"])


class FakeEngine:
    model_name = "fake"
    ready = healthy = serving = True
    failure = None

    def stats(self) -> dict:
        return {"num_blocks": 100, "num_free_blocks": 100, "block_size": 16}


def test_one_fetch_session_for_the_app_closed_with_it(server, executor):
    options = ImageOptions(fetch_timeout=5, max_images=4)
    app = create_app(FakeEngine(), web_ui=False, images=options)
    state = server_state(app)
    assert state.options.images is options
    assert server_state(create_app(FakeEngine(), web_ui=False)).options.images == ImageOptions()

    async def scenario():
        async with TestClient(TestServer(app)) as client:
            assert (await client.get("/health")).status == 200
            session = state.image_session()
            assert state.image_session() is session
            first = await read_image(server.url("/png"), PARAM, options, session, executor)
            second = await read_image(server.url("/jpeg"), PARAM, options, session, executor)
            assert first.digest != second.digest
        return session

    session = asyncio.run(scenario())
    assert session.closed  # app cleanup closed it


class RecordingExecutor(ThreadPoolExecutor):
    """Notes the threads its work ran on."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="recording")
        self.threads: list[str] = []

    def submit(self, fn, /, *args, **kwargs):
        def noted():
            self.threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return super().submit(noted)


def test_decoding_runs_on_the_executor(server, media):
    options = ImageOptions(fetch_timeout=5, allowed_media_dir=str(media / "media"))
    urls = [data_url(PNG), server.url("/png"), f"file://{media}/media/inside.png"]
    with RecordingExecutor() as pool:
        digests = {read(url, options, pool).digest for url in urls}
        assert len(digests) == 1
        assert len(pool.threads) == 3 and all(t.startswith("recording") for t in pool.threads)
