"""Routes about the server itself: /health, /server_info, /metrics, /openapi.json, and the ones
SGLang's model gateway (sglang-router) asks of its workers: /health_generate, /model_info,
/get_load, and the old names /get_server_info and /get_model_info."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
from aiohttp import web

import pyserve
from pyserve.http.errors import json_response
from pyserve.http.metrics import CONTENT_TYPE
from pyserve.http.openapi import openapi_document
from pyserve.http.state import ServerState
from pyserve.wire.main_to_worker import SamplingParams

# SGLang's default (SGLANG_HEALTH_CHECK_TIMEOUT): how long /health_generate waits for a token.
HEALTH_GENERATE_TIMEOUT_S = 20.0
_PROGRESS_POLL_S = 0.05
# SGLang's probe: one greedy token after the prompt [0], an id every vocabulary has.
_PROBE_PROMPT = [0]
_PROBE_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0)


class ServiceRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        self._openapi: bytes | None = None
        self._probe: asyncio.Task[str | None] | None = None  # the /health_generate in flight

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)  # SGLang's older name
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_load", self.load)
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

    def _status_body(self, status: str) -> dict:
        body = {"status": status}
        if status == "unhealthy":  # the engine has failed, or a step is stuck in the worker
            body["reason"] = self.engine.health_problem
        return body

    async def health(self, request: web.Request) -> web.Response:
        status = self.status()
        return json_response(self._status_body(status), status=200 if status == "ok" else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once the engine has produced a token since this probe began (SGLang's
        semantics: the probe's own token, or any running request's); 503 otherwise."""
        status = self.status()
        if status != "ok":
            return json_response(self._status_body(status), status=503)
        if self._probe is None or self._probe.done():
            # Probes that arrive together share one generation: a probe costs no more load
            # however often it is called (it needs no API key, as /health).
            self._probe = asyncio.ensure_future(self._generate_one_token())
        problem = await asyncio.shield(self._probe)
        if problem is not None:
            return json_response({"status": "unhealthy", "reason": problem}, status=503)
        return json_response({"status": "ok"})

    async def _generate_one_token(self) -> str | None:
        """None once a token came; otherwise why not."""
        started = self.engine.stats().get("handed_tokens", 0)
        generation = asyncio.ensure_future(self._probe_generation())
        deadline = time.monotonic() + HEALTH_GENERATE_TIMEOUT_S
        try:
            while not generation.done():
                # A busy engine may queue the probe behind a full batch: tokens handed to
                # other requests meanwhile show that it computes, as SGLang counts them.
                if self.engine.stats().get("handed_tokens", 0) > started:
                    return None
                if time.monotonic() >= deadline:
                    return f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:g} s"
                await asyncio.wait({generation}, timeout=_PROGRESS_POLL_S)
            if generation.cancelled():
                return "the probe was cancelled"
            exc = generation.exception()
            if exc is not None:
                return f"generation failed: {exc}"
            return generation.result()
        finally:
            generation.cancel()  # closing the stream aborts the probe request in the engine
            with contextlib.suppress(BaseException):
                await generation

    async def _probe_generation(self) -> str | None:
        stream = self.engine.generate(_PROBE_PROMPT, _PROBE_SAMPLING)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk.token_ids:
                    return None
                if chunk.finish_reason is not None:
                    return f"the probe ended without a token ({chunk.finish_reason})"
        return "the probe ended without a token"

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.engine.server_info()
        options = self.state.options
        info["http"] = {
            "api_key_required": options.api_key is not None,  # never the key itself
            "max_body_bytes": options.max_body_bytes,
            "max_queued_requests": options.max_queued_requests,
            "log_requests": options.log_requests,
        }
        images = options.images
        info["images"] = {  # where a chat's image_url parts may come from (never the paths)
            "fetch": images.fetch,
            "file_urls": images.allowed_media_dir is not None,
            "max_bytes": images.max_bytes,
            "max_images_per_request": images.max_images,
        }
        info["modalities"] = ["text", "image"] if self.engine.takes_images else ["text"]
        info["status"] = self.status()
        info["requests_in_flight"] = self.state.in_flight
        # SGLang's names for the same facts, which sglang-router reads when a worker registers
        # (served_model_name becomes the model's id in its /v1/models). The engine's own keys win.
        config = info.get("config", {})
        budget = info.get("prefill_budget", {})
        for key, value in {
            "served_model_name": self.engine.model_name,
            "tokenizer_path": self._tokenizer_path(),
            "tp_size": config.get("tp_size"),
            "dp_size": 1,  # a pyserve server is one data-parallel replica; --dp runs several
            "max_total_tokens": info.get("kv_cache", {}).get("tokens"),
            "max_running_requests": config.get("max_running_requests"),
            "max_prefill_tokens": budget.get("max_prefill_tokens"),
            "chunked_prefill_size": budget.get("chunked_prefill_size"),
            "version": pyserve.__version__,
        }.items():
            info.setdefault(key, value)
        return json_response(info)

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's /model_info: what a gateway needs to name the model and load its tokenizer."""
        info = self.engine.model_info
        return json_response(
            {
                "model_path": self.state.model_path(),
                "served_model_name": self.engine.model_name,
                "tokenizer_path": self._tokenizer_path(),
                "is_generation": True,  # pyserve serves causal LMs only (no embeddings)
                # HF config's model_type, or a GGUF's general.architecture (the same names)
                "model_type": info.architecture if info is not None else None,
                "context_length": self.engine.context_length,
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        """SGLang's /get_load, one entry per data-parallel rank (a pyserve server is one):
        requests, and tokens of KV that running requests hold (the cache's evictable blocks
        do not count, as in SGLang). The router's power-of-two policy compares num_tokens."""
        stats = await self.state.call(self.engine.core_stats())  # read now, not a snapshot
        running, waiting = stats["num_running"], stats["num_waiting"]
        held = self.engine.num_blocks - stats["num_free_blocks"] - stats["evictable_blocks"]
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": running + waiting,
                    "num_waiting_reqs": waiting,
                    "num_tokens": held * self.engine.block_size,
                }
            ]
        )

    def _tokenizer_path(self) -> str | None:
        # the directory the engine loaded it from (a GGUF's is the converted copy in the cache)
        tokenizer = self.engine.tokenizer
        return getattr(tokenizer, "name_or_path", None) or None

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.state.metrics.render(), headers={"Content-Type": CONTENT_TYPE}
        )

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            self._openapi = msgspec.json.encode(openapi_document(pyserve.__version__))
        return web.Response(body=self._openapi, content_type="application/json")
