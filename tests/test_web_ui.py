"""The chat page (/) and the live dashboard (/dashboard) in a real headless Chromium.

Debian's ``chromium`` is driven by Playwright for Python through ``executable_path`` (never a
browser downloaded by ``playwright install``). Two servers serve the module: a ``pyserve run``
subprocess, and pyserve's app mounted under /llm/ with an API key inside an aiohttp application
of this process (as a gateway would embed it). Screenshots go to pytest's temporary directory and
to /tmp/web-ui-screenshots/, for people to look at. Nothing here judges speed: every wait has a
generous limit against hangs only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from aiohttp import web
from http_testlib import (
    HANG_GUARD_S,
    kv_idle,
    metrics,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)
from playwright import sync_api
from vision_models import build_tiny_vlm

from pyserve import Engine, EngineConfig, create_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS_COPY = Path("/tmp/web-ui-screenshots")
KV_TOKENS = 32768
API_KEY = "web-ui-test-key"
LONG_ANSWER = 4000  # tokens: the tiny model streams for a while, and rarely says EOS
SERVER_ARGS = ["--torch-threads", "1", "--tokenizer-workers", "1"]
SERVER_ARGS += ["--kv-cache-tokens", str(KV_TOKENS)]
SERVER_ARGS += ["--fairness", "tenant"]  # the dashboard's table of tenants


@pytest.fixture(scope="module", autouse=True)
def chromium_installed():
    """The browser is part of the suite (`make test` installs it), so its absence fails."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")


# ------------------------------------------------------------------ servers and browser


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(["--model", str(model_dir), *SERVER_ARGS]) as server:
        yield server


class MountedServer:
    """An aiohttp application of its own, on a thread of this process, with pyserve's app
    (API key required) mounted under /llm."""

    def __init__(self, model_dir: Path) -> None:
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(model_dir,), daemon=True)
        self._thread.start()
        assert self._started.wait(HANG_GUARD_S * 3), "the mounted server did not start"
        if self._error is not None:
            self.close()
            raise self._error

    def _run(self, model_dir: Path) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(model_dir))
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()
        if self._error is None:
            self._loop.run_forever()
        self._loop.close()

    async def _start(self, model_dir: Path) -> None:
        config = EngineConfig(model=str(model_dir), kv_cache_tokens=KV_TOKENS, torch_threads=1)
        config.tokenizer_workers = 1
        self.engine = Engine(config)
        parent = web.Application()

        async def index(_: web.Request) -> web.Response:
            return web.json_response({"service": "a gateway"})

        parent.router.add_get("/", index)
        parent.add_subapp("/llm", create_app(self.engine, api_key=API_KEY))
        self.runner = web.AppRunner(parent)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        await self.engine.start()

    async def _stop(self) -> None:
        await self.engine.shutdown()
        await self.runner.cleanup()

    def close(self) -> None:
        if self._error is None:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(HANG_GUARD_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(HANG_GUARD_S)


@pytest.fixture(scope="module")
def mounted(model_dir):
    server = MountedServer(model_dir)
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Watched:
    """A page in a fresh context (its own localStorage), with what went wrong on it."""

    def __init__(
        self, browser, shots: Path, width: int = 1280, height: int = 800, dark: bool = False
    ) -> None:
        self.context = browser.new_context(
            viewport={"width": width, "height": height},
            color_scheme="dark" if dark else "light",
        )
        self.page = self.context.new_page()
        self.page.set_default_timeout(HANG_GUARD_S * 1000)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        self.page.on("console", self._console)
        self._shots = shots

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text}")

    def shot(self, name: str, full_page: bool = False) -> Path:
        path = self._shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        SHOTS_COPY.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, SHOTS_COPY / path.name)
        return path

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("web-ui-screenshots")


@pytest.fixture
def watched(browser, shots):
    opened: list[Watched] = []

    def open_page(**size) -> Watched:
        opened.append(Watched(browser, shots, **size))
        return opened[-1]

    yield open_page
    for page in opened:
        page.close()


def wait_until(page, condition: str) -> None:
    """Waits until a JavaScript condition holds. A function, not a bare expression: Playwright
    would poll a bare one through eval(), which the pages' Content-Security-Policy forbids."""
    page.wait_for_function(f"() => {condition}")


def open_chat(watched, url: str) -> Watched:
    w = watched()
    w.page.goto(url)
    wait_until(w.page, "document.getElementById('model-name').textContent.includes('tiny')")
    return w


def ask(page, question: str, *, max_tokens: int, temperature: float = 0.0) -> None:
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


ANSWER = ".msg.assistant >> nth=-1"


def answer_length(page) -> int:
    return page.evaluate(
        "[...document.querySelectorAll('.msg.assistant .body')].pop().textContent.length"
    )


def wait_answer_done(page) -> str:
    """The last answer's statistics line, once it has ended."""
    page.wait_for_selector("#send:not([hidden])")
    wait_until(
        page, "[...document.querySelectorAll('.msg.assistant .stats')].pop().textContent.length > 0"
    )
    return page.locator(f"{ANSWER} >> .stats").inner_text()


# ------------------------------------------------------------------ headers and routes


def test_pages_have_a_strict_csp_and_revalidating_cache_headers(server):
    for path, kind in [("/", "text/html"), ("/dashboard", "text/html")]:
        status, headers, body = request(server.url + path)
        assert status == 200 and headers["Content-Type"].startswith(kind)
        csp = headers["Content-Security-Policy"]
        for directive in ("default-src 'self'", "script-src 'self'", "connect-src 'self'"):
            assert directive in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert headers["Cache-Control"] == "no-cache" and headers["ETag"]
        assert headers["X-Content-Type-Options"] == "nosniff"
        html = body.decode()
        # no inline script: every <script> names a file of this server, by a relative URL
        for script in re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S):
            assert not script.strip()
        assert re.findall(r'<script[^>]*src="(static/[a-z]+\.js)"', html)
        assert 'src="/' not in html and 'href="/' not in html  # relative URLs only

    status, headers, _ = request(server.url + "/static/chat.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    etag = headers["ETag"]
    status, headers, body = request(server.url + "/static/chat.js", headers={"If-None-Match": etag})
    assert status == 304 and body == b"" and headers["ETag"] == etag
    assert request(server.url + "/static/no-such-file.js")[0] == 404

    status, headers, body = request(server.url + "/stats")
    assert status == 200 and headers["Cache-Control"] == "no-store"
    doc = json.loads(body)
    assert doc["kv_blocks_total"] == KV_TOKENS // 16 and doc["interval_s"] == 1.0
    sample = doc["samples"][-1]
    for key in ("t", "output_tokens_per_s", "running", "waiting", "kv_blocks_used"):
        assert key in sample
    later = json.loads(request(f"{server.url}/stats?since={sample['t']}")[2])
    assert all(s["t"] > sample["t"] for s in later["samples"])
    assert request(server.url + "/stats?since=soon")[0] == 400


def test_the_ready_line_names_the_pages(server):
    ready = next(line for line in server.lines if "pyserve is ready at" in line)
    assert f"chat page: {server.url}/" in ready and f"{server.url}/dashboard" in ready


# ------------------------------------------------------------------ the chat page


def test_chat_page_loads_without_errors(server, watched):
    w = open_chat(watched, server.url + "/")
    assert w.page.locator("#model-name").inner_text() == "http-tiny-model"
    assert w.page.locator("#server-status").inner_text() == "ready"
    assert w.page.locator("a.nav-link").get_attribute("href") == "dashboard"
    w.shot("chat-empty")
    assert w.errors == []


def test_an_answer_streams_and_stop_aborts_it_on_the_server(server, watched):
    w = open_chat(watched, server.url + "/")
    page = w.page
    before = metrics(server.url)
    # Greedy output is the same every run; if a question ends early anyway (an EOS), ask another.
    for question in ("Tell me a long story about the sea.", "Count to a million.", "Go on."):
        ask(page, question, max_tokens=LONG_ANSWER)
        lengths = [answer_length(page)]
        deadline = time.monotonic() + HANG_GUARD_S
        while len(set(lengths)) < 4 and page.locator("#stop").is_visible():
            assert time.monotonic() < deadline, f"the answer did not grow: {lengths}"
            time.sleep(0.1)
            if (length := answer_length(page)) != lengths[-1]:
                lengths.append(length)
        if page.locator("#stop").is_visible():
            break
        wait_answer_done(page)
    else:
        pytest.fail("every answer ended before it could be stopped")
    assert lengths == sorted(lengths) and len(set(lengths)) >= 4  # it grew, step by step
    assert wait_for_metrics(server.url, lambda m: m["pyserve_requests_running"] >= 1)
    w.shot("chat-streaming")

    page.click("#stop")
    stats = wait_answer_done(page)
    # The aborted request leaves the core, and its handler counts the tokens it got.
    after = wait_for_metrics(
        server.url,
        lambda m: (
            m["pyserve_requests_running"] == 0
            and m["pyserve_generation_tokens_total"] > before["pyserve_generation_tokens_total"]
        ),
    )
    assert "stopped" in stats and "tokens/s" in stats and "TTFT" in stats
    generated = after["pyserve_generation_tokens_total"] - before["pyserve_generation_tokens_total"]
    assert 0 < generated < LONG_ANSWER  # aborted, not run to max_tokens
    assert kv_idle(wait_for_metrics(server.url, kv_idle))
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()
    w.shot("chat-stopped")
    assert w.errors == []


def test_each_answer_shows_tokens_per_second_and_ttft(server, watched):
    w = open_chat(watched, server.url + "/")
    ask(w.page, "What is the capital of France?", max_tokens=24)
    stats = wait_answer_done(w.page)
    assert re.fullmatch(
        r"24 tokens · [0-9.,]+ tokens/s · TTFT [0-9.]+ m?s · max_tokens reached", stats
    ), stats
    assert w.errors == []


def test_conversations_survive_a_reload(server, watched):
    w = open_chat(watched, server.url + "/")
    page = w.page
    page.fill("#system-prompt", "You answer briefly.")
    page.dispatch_event("#system-prompt", "change")
    ask(page, "First question", max_tokens=8)
    wait_answer_done(page)
    page.click("#new-chat")
    ask(page, "Second question", max_tokens=8)
    wait_answer_done(page)
    first_answer = page.locator(f"{ANSWER} >> .body").inner_text()

    page.reload()
    wait_until(page, "document.getElementById('model-name').textContent.includes('tiny')")
    titles = page.locator("#conversations li button.open").all_inner_texts()
    assert titles == ["Second question", "First question"]
    assert page.locator(".msg.user .body").all_inner_texts() == ["Second question"]
    assert page.locator(f"{ANSWER} >> .body").inner_text() == first_answer
    assert page.locator("#system-prompt").input_value() == "You answer briefly."
    page.click("#conversations li >> nth=1 >> button.open")
    assert page.locator(".msg.user .body").all_inner_texts() == ["First question"]
    page.click("#conversations li >> nth=1 >> button.delete")
    assert page.locator("#conversations li").count() == 1
    assert w.errors == []


def overflowing(page) -> list[str]:
    """The elements that stick out of the window sideways (a page should scroll only down)."""
    return page.evaluate(
        """() => [...document.querySelectorAll("body *")]
            .filter((e) => e.getBoundingClientRect().right > window.innerWidth + 1)
            .map((e) => `${e.tagName.toLowerCase()}#${e.id}.${e.className}`)"""
    )


MARKDOWN_SAMPLE = """# A heading

Some **bold**, *italic*, ~~struck~~ and `inline code`; a [link](https://example.com) and
a bare https://example.org/path.

- one
- two
  1. nested
  2. items

```python
def greet(name):
    return f"<b>{name}</b>"
```

> a quote

| a | b |
|---|--:|
| 1 | 2 |

<script>alert(1)</script> <img src=x onerror="window.injected=1"> [bad](javascript:alert(3))
"""


def test_markdown_renders_safely(server, watched):
    w = open_chat(watched, server.url + "/")
    page = w.page
    rendered = page.evaluate(
        """async (source) => {
            const { renderMarkdown } = await import("./static/markdown.js");
            const box = document.createElement("div");
            box.append(renderMarkdown(source));
            const tags = [...box.querySelectorAll("*")].map((e) => e.tagName.toLowerCase());
            return {
                tags,
                links: [...box.querySelectorAll("a")].map((a) => a.getAttribute("href")),
                code: box.querySelector("pre code").textContent,
                codeClass: box.querySelector("pre code").className,
                text: box.textContent,
            };
        }""",
        MARKDOWN_SAMPLE,
    )
    tags = set(rendered["tags"])
    assert {"h1", "strong", "em", "del", "code", "ul", "ol", "li", "pre", "blockquote"} <= tags
    assert {"table", "th", "td", "a", "p"} <= tags
    assert not tags & {"script", "img", "iframe", "b"}  # model output never becomes markup
    assert rendered["links"] == ["https://example.com", "https://example.org/path"]
    assert rendered["code"] == 'def greet(name):\n    return f"<b>{name}</b>"'
    assert rendered["codeClass"] == "language-python"
    assert "<script>alert(1)</script>" in rendered["text"]
    assert "[bad](javascript:alert(3))" in rendered["text"]

    # The same answer in a stored conversation, for the screenshot.
    page.evaluate(
        """async (source) => {
            const { save } = await import("./static/common.js");
            const messages = [
                { role: "user", content: "Show me some Markdown." },
                { role: "assistant", content: source, stats: { tokens: 120, exact: true,
                  ttft: 0.042, tokensPerS: 350.5, finish: "stop" } },
            ];
            save("conversations", [{ id: "md", title: "Markdown", messages }]);
            save("current", "md");
        }""",
        MARKDOWN_SAMPLE,
    )
    page.reload()
    page.wait_for_selector(".msg.assistant .body h1")
    assert page.evaluate("window.injected") is None
    w.shot("chat-markdown")
    page.set_viewport_size({"width": 390, "height": 844})  # a phone: nothing may overflow
    page.reload()
    page.wait_for_selector(".msg.assistant .body h1")
    assert overflowing(page) == []
    w.shot("chat-narrow", full_page=True)
    assert w.errors == []


# ------------------------------------------------------------------ images in the chat


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of ``rgb`` fading to black downwards, written by hand (no imaging library)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    rows = b"".join(
        b"\0" + bytes(c * (height - y) // height for c in rgb) * width for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + b"".join(
        (chunk(b"IHDR", header), chunk(b"IDAT", zlib.compress(rows)), chunk(b"IEND", b""))
    )


CANNED_ANSWER = "A square, fading from colour to black."


def canned_stream() -> str:
    """An answer as OpenAI streams it: role, text pieces, the finish, the usage, [DONE]."""
    chunk = {"id": "chatcmpl-canned", "object": "chat.completion.chunk", "created": 0}
    deltas = [{"role": "assistant", "content": ""}]
    deltas += [{"content": word} for word in re.findall(r"\S+\s*", CANNED_ANSWER)]
    events = [
        {**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
    ]
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 12, "completion_tokens": len(deltas) - 1, "total_tokens": 20}
    events.append({**chunk, "choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"


def as_an_image_server(page) -> list[dict]:
    """Makes the page's server one that takes images: its /server_info (the real answer) gains
    ``"modalities": ["text", "image"]``, and chat completions are answered here with a canned
    stream. Returns the list that each completion request (body, URL, key) is appended to."""
    sent: list[dict] = []

    def server_info(route) -> None:
        response = route.fetch()
        route.fulfill(response=response, json={**response.json(), "modalities": ["text", "image"]})

    def completions(route) -> None:
        request = route.request
        sent.append(
            {
                "body": request.post_data_json,
                "url": request.url,
                "authorization": request.headers.get("authorization"),
            }
        )
        route.fulfill(status=200, content_type="text/event-stream", body=canned_stream())

    page.route("**/server_info", server_info)
    page.route("**/v1/chat/completions", completions)
    return sent


def hand_over(page, event: str, files: list[tuple[str, str, bytes | int]], target: str) -> None:
    """Dispatches a ``paste`` (ClipboardEvent) or ``drop`` (DragEvent) carrying ``files``
    (name, MIME type, bytes or a size in zero bytes) on the element ``target``, as a person's
    paste or drop would."""
    page.evaluate(
        """([event, files, target]) => {
            const data = new DataTransfer();
            for (const [name, type, content] of files) {
                const bytes = typeof content === "number"
                    ? new Uint8Array(content)
                    : Uint8Array.from(atob(content), (c) => c.charCodeAt(0));
                data.items.add(new File([bytes], name, { type }));
            }
            const init = { bubbles: true, cancelable: true };
            const element = document.querySelector(target);
            if (event === "paste") {
                init.clipboardData = data;
                element.dispatchEvent(new ClipboardEvent("paste", init));
            } else {
                init.dataTransfer = data;
                element.dispatchEvent(new DragEvent("dragover", init));
                element.dispatchEvent(new DragEvent("drop", init));
            }
        }""",
        [
            event,
            [
                (n, t, c if isinstance(c, int) else base64.b64encode(c).decode())
                for n, t, c in files
            ],
            target,
        ],
    )


def wait_thumbnails(page, count: int) -> list[str]:
    """The alt texts of the images waiting for the next message, once ``count`` have loaded."""
    wait_until(
        page,
        "(() => { const images = [...document.querySelectorAll('#attachments .thumb img')];"
        f" return images.length === {count}"
        " && images.every((i) => i.complete && i.naturalWidth > 0); })()",
    )
    return page.eval_on_selector_all("#attachments .thumb img", "(all) => all.map((i) => i.alt)")


def image_parts(content: list[dict]) -> list[bytes]:
    """The bytes of a message's image_url parts (PNG data URLs)."""
    found = []
    for part in content:
        if part["type"] == "image_url":
            prefix, data = part["image_url"]["url"].split(",", 1)
            assert prefix == "data:image/png;base64"
            found.append(base64.b64decode(data))
    return found


def test_images_go_with_a_message_and_stay_in_its_history(mounted, watched):
    """Under a prefix, with a key: attach (file button, paste, drop), remove, send; the request
    carries OpenAI's content parts, and later turns resend the pictures."""
    w = watched()
    page = w.page
    sent = as_an_image_server(page)
    page.goto(mounted.url + "/llm/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", API_KEY)
    page.press("#key-input", "Enter")
    wait_until(page, "document.getElementById('model-name').textContent.includes('tiny')")
    assert page.locator("#attach").is_visible()
    assert page.get_by_role("button", name="Attach images").is_visible()

    red, blue, green = (
        png(96, 64, (220, 40, 40)),
        png(64, 64, (40, 80, 220)),
        png(48, 80, (40, 160, 60)),
    )
    page.set_input_files(
        "#attach-input",
        [
            {"name": "red.png", "mimeType": "image/png", "buffer": red},
            {"name": "blue.png", "mimeType": "image/png", "buffer": blue},
        ],
    )
    assert wait_thumbnails(page, 2) == ["red.png", "blue.png"]
    page.get_by_role("button", name="Remove blue.png").click()
    assert wait_thumbnails(page, 1) == ["red.png"]
    w.shot("chat-image-attached")

    ask(page, "What is in this picture?", max_tokens=16)
    wait_answer_done(page)
    assert page.locator("#attachments").is_hidden() and wait_thumbnails(page, 0) == []
    first = sent[-1]
    assert first["authorization"] == f"Bearer {API_KEY}"
    assert first["url"] == mounted.url + "/llm/v1/chat/completions"
    question = first["body"]["messages"][-1]
    assert question["role"] == "user"
    assert question["content"][0] == {"type": "text", "text": "What is in this picture?"}
    assert len(question["content"]) == 2 and image_parts(question["content"]) == [red]
    bubble = page.locator(".msg.user >> nth=0")
    assert bubble.locator(".body").inner_text().strip() == "What is in this picture?"
    wait_until(page, "document.querySelector('.msg.user .images img').naturalWidth === 96")
    assert page.locator(f"{ANSWER} >> .body").inner_text() == CANNED_ANSWER
    w.shot("chat-image-conversation")

    # Full size, in an overlay that any click closes.
    bubble.get_by_role("button", name="Image 1, full size").click()
    page.wait_for_selector("#image-dialog[open]")
    assert (
        page.locator("#image-full").get_attribute("src")
        == question["content"][1]["image_url"]["url"]
    )
    w.shot("chat-image-full-size")
    page.click("#image-full")
    page.wait_for_selector("#image-dialog:not([open])", state="attached")

    # A follow-up about the same picture: the history resends it; the new text stays a string.
    ask(page, "And what colour is it?", max_tokens=16)
    wait_answer_done(page)
    assert sent[-1]["body"]["messages"] == [
        question,
        {"role": "assistant", "content": CANNED_ANSWER},
        {"role": "user", "content": "And what colour is it?"},
    ]

    # Too big, or not an image: refused with a note, nothing attached.
    too_big = 20 * 1024 * 1024 + 1
    files = [("huge.png", "image/png", too_big), ("paper.pdf", "application/pdf", b"%PDF-1.7")]
    hand_over(page, "paste", files, "#prompt")
    wait_until(page, "document.getElementById('attach-note').textContent.includes('over 20 MiB')")
    assert "paper.pdf is not a PNG" in page.locator("#attach-note").inner_text()
    assert wait_thumbnails(page, 0) == []

    # Pasted into the message box, then dropped on the conversation: sent alone, no text.
    hand_over(page, "paste", [("blue.png", "image/png", blue)], "#prompt")
    assert wait_thumbnails(page, 1) == ["blue.png"]
    assert page.locator("#attach-note").is_hidden()
    hand_over(page, "drop", [("green.png", "image/png", green)], "#messages")
    assert wait_thumbnails(page, 2) == ["blue.png", "green.png"]
    page.press("#prompt", "Enter")
    wait_answer_done(page)
    last = sent[-1]["body"]["messages"][-1]
    assert [part["type"] for part in last["content"]] == ["image_url", "image_url"]
    assert image_parts(last["content"]) == [blue, green]

    # Kept in this browser: after a reload the bubbles still show all three pictures.
    page.reload()
    wait_until(page, "document.querySelectorAll('.msg.user .images img').length === 3")
    assert page.locator("#conversations li button.open").all_inner_texts() == [
        "What is in this picture?"
    ]
    w.shot("chat-image-reloaded")

    # On a phone, with a picture waiting and a note: nothing sticks out sideways.
    page.set_viewport_size({"width": 390, "height": 844})
    hand_over(
        page,
        "paste",
        [("red.png", "image/png", red), ("paper.pdf", "application/pdf", b"")],
        "#prompt",
    )
    assert wait_thumbnails(page, 1) == ["red.png"]
    assert overflowing(page) == []
    w.shot("chat-image-narrow", full_page=True)
    page.get_by_role("button", name="Remove red.png").click()
    page.set_viewport_size({"width": 1280, "height": 800})

    # A picture too big for localStorage: sent whole, but the stored conversation keeps the
    # words only; after a reload the bubbles say so, and later turns send the text alone.
    big = 9 * 1024 * 1024
    hand_over(page, "paste", [("big.png", "image/png", big)], "#prompt")
    wait_until(page, "document.querySelectorAll('#attachments .thumb').length === 1")
    ask(page, "A big one", max_tokens=16)
    wait_answer_done(page)
    assert image_parts(sent[-1]["body"]["messages"][-1]["content"]) == [bytes(big)]
    page.reload()
    wait_until(page, "document.querySelectorAll('.msg.user .image-gone').length === 4")
    ask(page, "Still there?", max_tokens=16)
    wait_answer_done(page)
    assert [m["content"] for m in sent[-1]["body"]["messages"] if m["role"] == "user"] == [
        "What is in this picture?",
        "And what colour is it?",
        "(an image that this browser did not keep)",
        "A big one",
        "Still there?",
    ]
    assert [e for e in w.errors if "status of 401" not in e] == []


def test_a_server_without_images_hides_the_button_and_sends_plain_text(server, watched):
    w = open_chat(watched, server.url + "/")
    page = w.page
    assert page.locator("#attach").is_hidden()
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json),
    )
    hand_over(page, "paste", [("red.png", "image/png", png(8, 8, (255, 0, 0)))], "#prompt")
    wait_until(page, "document.getElementById('attach-note').textContent.includes('no images')")
    hand_over(page, "drop", [("red.png", "image/png", png(8, 8, (255, 0, 0)))], "#messages")
    assert page.locator("#attachments").is_hidden() and wait_thumbnails(page, 0) == []
    ask(page, "Just words", max_tokens=4)
    wait_answer_done(page)
    assert bodies[-1]["messages"] == [{"role": "user", "content": "Just words"}]
    assert page.locator("#attach-note").is_hidden()
    assert w.errors == []


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    """A server of a tiny vision model (Idefics3, ``vision_models.py``): it takes images."""
    model = build_tiny_vlm(
        tmp_path_factory.mktemp("vision") / "tiny-idefics3", family="idefics3", seed=0
    )
    with running_server(["--model", str(model), *SERVER_ARGS]) as server:
        yield server


def test_a_picture_from_the_page_reaches_a_vision_model(vision_server, watched):
    """A real vision model: the page sends the attached picture, the answer is the one the API
    gives for the same request, and the next turn sends the picture and that answer again."""
    w = open_chat(watched, vision_server.url + "/")
    page = w.page
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json),
    )
    assert page.locator("#attach").is_visible()
    picture = png(96, 64, (220, 40, 40))
    page.set_input_files(
        "#attach-input", [{"name": "red.png", "mimeType": "image/png", "buffer": picture}]
    )
    assert wait_thumbnails(page, 1) == ["red.png"]
    ask(page, "What is in this picture?", max_tokens=8)
    wait_answer_done(page)
    first = bodies[-1]
    assert image_parts(first["messages"][-1]["content"]) == [picture]
    status, _, raw = request(vision_server.url + "/v1/chat/completions", {**first, "stream": False})
    assert status == 200, raw
    expected = json.loads(raw)["choices"][0]["message"]["content"]
    ask(page, "And now?", max_tokens=4)
    wait_answer_done(page)
    history = bodies[-1]["messages"]
    assert history[-2] == {"role": "assistant", "content": expected}
    assert image_parts(history[-3]["content"]) == [picture]
    w.shot("chat-image-vision-model")
    assert w.errors == []


# ------------------------------------------------------------------ the dashboard


def canvas_fingerprints(page) -> dict[str, tuple[int, str]]:
    """chart id → (non-blank pixels, a digest of the canvas) for every chart."""
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll(".chart")].map((box) => {
            const canvas = box.querySelector("canvas");
            const { width, height } = canvas;
            const data = canvas.getContext("2d").getImageData(0, 0, width, height).data;
            let inked = 0;
            for (let i = 3; i < data.length; i += 4) if (data[i]) inked += 1;
            return [box.id, [inked, canvas.toDataURL().slice(-64)]];
        }))"""
    )


def tiles(page) -> dict[str, str]:
    return page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('.tile .value')]"
        ".map((e) => [e.id, e.textContent]))"
    )


def load(
    url: str, count: int, headers: dict | None = None, user: str | None = None
) -> list[threading.Thread]:
    """``count`` concurrent chat requests, each some thousand tokens long, on threads."""
    body = {
        "messages": [{"role": "user", "content": "Keep talking."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "user": user,
    }
    threads = [
        threading.Thread(
            target=request,
            args=(url + "/v1/chat/completions", body),
            kwargs={"headers": headers},
            daemon=True,
        )
        for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    return threads


def colored_ink(page, chart: str) -> int:
    """Pixels of ``chart`` in a saturated colour: its series, not its grey grid and labels."""
    return page.evaluate(
        """(id) => {
            const canvas = document.querySelector(`#${id} canvas`);
            const { width, height } = canvas;
            const data = canvas.getContext("2d").getImageData(0, 0, width, height).data;
            let inked = 0;
            for (let i = 0; i < data.length; i += 4) {
                const [r, g, b, a] = data.slice(i, i + 4);
                if (a > 128 && Math.max(r, g, b) - Math.min(r, g, b) > 80) inked += 1;
            }
            return inked;
        }""",
        chart,
    )


def test_dashboard_figures_change_under_load(server, watched):
    w = watched(width=1280, height=1000)
    page = w.page
    page.goto(server.url + "/dashboard")
    wait_until(page, "document.getElementById('now-running').textContent === '0'")
    page.click("text=1 min")
    idle = tiles(page)
    before = canvas_fingerprints(page)
    assert all(inked > 0 for inked, _ in before.values())  # axes and grid at least

    threads = load(server.url, 6, user="dashboard <b>load</b>")  # shown as text, not markup
    wait_until(
        page,
        "Number(document.getElementById('now-running').textContent) > 0"
        " && parseFloat(document.getElementById('now-tokens').textContent.replace(',', '')) > 0",
    )
    time.sleep(2.5)  # a few more samples, so that the lines have some length in the screenshot
    busy = tiles(page)
    during = canvas_fingerprints(page)
    wait_until(page, "document.getElementById('tenant-rows').textContent.includes('<b>load</b>')")
    cells = page.locator("#tenant-rows tr", has_text="dashboard <b>load</b>").locator("td")
    assert int(cells.nth(1).inner_text().replace(",", "")) > 0  # tokens served
    w.shot("dashboard-under-load", full_page=True)
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert busy["now-tokens"] != idle["now-tokens"] and busy["now-running"] != idle["now-running"]
    assert busy["now-ttft"] != "–" and busy["now-itl"] != "–" and busy["now-batch"] != "–"
    for chart in ("chart-tokens", "chart-requests", "chart-kv", "chart-ttft", "chart-itl"):
        assert during[chart] != before[chart], f"{chart} did not change"
        assert colored_ink(page, chart) > 0, f"{chart} drew no series"
    wait_until(page, "document.getElementById('now-running').textContent === '0'")
    w.shot("dashboard-after-load", full_page=True)
    assert w.errors == []


# ------------------------------------------------------------------ mounted under /llm/, with a key


def test_under_a_prefix_with_an_api_key_the_page_asks_for_the_key_then_works(mounted, watched):
    w = watched(dark=True)  # and in the dark theme, for the screenshots
    page = w.page
    page.goto(mounted.url + "/llm")  # no slash: redirected, so that relative URLs resolve
    assert page.url == mounted.url + "/llm/"
    page.wait_for_selector("#key-dialog[open]")
    w.shot("chat-api-key")
    page.fill("#key-input", "not-the-key")
    page.press("#key-input", "Enter")
    wait_until(page, "document.getElementById('key-message').textContent.includes('refused')")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", API_KEY)
    page.press("#key-input", "Enter")
    wait_until(page, "document.getElementById('model-name').textContent.includes('tiny')")
    assert not page.locator("#key-dialog").is_visible()

    ask(page, "Hello under a prefix", max_tokens=16)
    stats = wait_answer_done(page)
    assert stats.startswith("16 tokens · ") and "TTFT" in stats
    w.shot("chat-under-prefix")

    # The dashboard, under the same prefix, finds the key that this browser kept.
    page.goto(mounted.url + "/llm/dashboard")
    wait_until(page, "document.getElementById('model-name').textContent.includes('tiny')")
    assert not page.locator("#key-dialog").is_visible()
    threads = load(mounted.url + "/llm", 2, headers={"Authorization": f"Bearer {API_KEY}"})
    wait_until(page, "Number(document.getElementById('now-running').textContent) > 0")
    for thread in threads:
        thread.join(HANG_GUARD_S)
    wait_until(page, "document.getElementById('now-running').textContent === '0'")
    assert page.locator("#tenants").is_hidden()  # no --fairness tenant
    w.shot("dashboard-under-prefix", full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    assert overflowing(page) == []
    w.shot("dashboard-narrow", full_page=True)
    # Only the requests that the server refused before the key was given may have failed.
    assert [e for e in w.errors if "status of 401" not in e] == []
