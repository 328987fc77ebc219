"""Routes about the server itself: /health, /server_info, /metrics, /openapi.json."""

from __future__ import annotations

import msgspec
from aiohttp import web

import pyserve
from pyserve.http.errors import json_response
from pyserve.http.metrics import CONTENT_TYPE
from pyserve.http.openapi import openapi_document
from pyserve.http.state import ServerState


class ServiceRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        self._openapi: bytes | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)

    def status(self) -> str:
        if self.state.draining:
            return "shutting_down"
        if not self.engine.ready:
            return "loading"
        if not self.engine.healthy:
            return "unhealthy"
        return "ok"

    async def health(self, request: web.Request) -> web.Response:
        status = self.status()
        body = {"status": status}
        if status == "unhealthy":  # the engine has failed, or a step is stuck in the worker
            body["reason"] = self.engine.health_problem
        return json_response(body, status=200 if status == "ok" else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.engine.server_info()
        options = self.state.options
        info["http"] = {
            "api_key_required": options.api_key is not None,  # never the key itself
            "max_body_bytes": options.max_body_bytes,
            "max_queued_requests": options.max_queued_requests,
            "log_requests": options.log_requests,
        }
        info["status"] = self.status()
        info["requests_in_flight"] = self.state.in_flight
        return json_response(info)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.state.metrics.render(), headers={"Content-Type": CONTENT_TYPE}
        )

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            self._openapi = msgspec.json.encode(openapi_document(pyserve.__version__))
        return web.Response(body=self._openapi, content_type="application/json")
