"""The pages for people: a chat page at ``/`` and a live dashboard at ``/dashboard``.

The files live in ``pyserve/web/`` and are read once, when the app is made. They use relative
URLs only, so the pages work wherever the app is mounted (``/``, ``/llm/``, ...). They load
without the API key (they ask for it; the API behind them still needs it) and while the model
loads. Every answer carries a strict Content-Security-Policy: scripts, styles and connections
from this origin only, no inline script, nothing from the internet. ``no-cache`` with an ETag
makes a browser revalidate each time (a 304 costs a few bytes), so an upgraded server never
serves a stale mix of old and new files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).resolve().parent.parent / "web"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'self'",
    )
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str

    @classmethod
    def load(cls, path: Path) -> Asset:
        body = path.read_bytes()
        digest = hashlib.sha256(body).hexdigest()[:20]
        return cls(body, CONTENT_TYPES[path.suffix], f'"{digest}"')

    def response(self, request: web.Request) -> web.Response:
        headers = {**SECURITY_HEADERS, "ETag": self.etag}
        if self.etag in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers=headers)
        headers["Content-Type"] = self.content_type
        return web.Response(body=self.body, headers=headers)


class WebUI:
    def __init__(self, directory: Path = WEB_DIR) -> None:
        self.pages = {
            "chat": Asset.load(directory / "chat.html"),
            "dashboard": Asset.load(directory / "dashboard.html"),
        }
        self.static = {
            path.name: Asset.load(path)
            for path in sorted((directory / "static").iterdir())
            if path.suffix in CONTENT_TYPES
        }
        # What answers without the API key and before the engine is ready.
        self.handlers = {self.chat, self.dashboard, self.static_file, self.to_slash}

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/", self.chat)
        # Mounted under a prefix, "/llm" must become "/llm/": the pages' relative URLs resolve
        # against the last slash. (Served at the root, this route never matches.)
        app.router.add_get("", self.to_slash)
        app.router.add_get("/dashboard", self.dashboard)
        app.router.add_get("/static/{name}", self.static_file)

    async def chat(self, request: web.Request) -> web.Response:
        return self.pages["chat"].response(request)

    async def dashboard(self, request: web.Request) -> web.Response:
        return self.pages["dashboard"].response(request)

    async def static_file(self, request: web.Request) -> web.Response:
        asset = self.static.get(request.match_info["name"])
        if asset is None:
            raise web.HTTPNotFound()
        return asset.response(request)

    async def to_slash(self, request: web.Request) -> web.Response:
        location = request.path + "/"
        if request.query_string:
            location += "?" + request.query_string
        raise web.HTTPPermanentRedirect(location)
