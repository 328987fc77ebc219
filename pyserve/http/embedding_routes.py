"""``/v1/embeddings`` (OpenAI's shape) and ``/v1/rerank`` (Jina's and Cohere's, also at
``/rerank``): thin adapters over ``Engine.embed`` and ``Engine.rerank``.

Every input of a request becomes its own prefill-only engine request, all submitted at once, so
the scheduler batches them (with each other and with generation). A body that cannot be served
is refused here or by the engine before anything reaches the worker.
"""

from __future__ import annotations

import array
import base64
import logging
import uuid

from aiohttp import web

from pyserve.engine.embeddings import gather_all
from pyserve.http.bodies import read_request
from pyserve.http.errors import bad_request, json_response
from pyserve.http.protocol import EmbeddingRequest, RerankDocument, RerankRequest
from pyserve.http.state import ServerState

log = logging.getLogger("pyserve.http")


def _inputs(value: str | list) -> list[str | list[int]]:
    """The request's inputs: texts or token-id lists, never a mix, never empty."""
    if isinstance(value, str):
        value = [value]
    elif all(isinstance(item, int) for item in value):
        return [value]  # one input as token ids
    inputs: list[str | list[int]] = []
    for i, item in enumerate(value):
        if isinstance(item, int):
            raise bad_request(
                "input: a list mixes token ids with texts or lists", param=f"input[{i}]"
            )
        if len(item) == 0:
            raise bad_request("input: an input is empty", param=f"input[{i}]")
        inputs.append(item)
    kinds = {isinstance(item, str) for item in inputs}
    if len(kinds) > 1:
        raise bad_request("input: a list mixes texts with token-id lists", param="input")
    return inputs


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes."""
    return base64.b64encode(array.array("f", vector).tobytes()).decode("ascii")


class EmbeddingRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/rerank", self.rerank)
        app.router.add_post("/rerank", self.rerank)

    async def embeddings(self, request: web.Request) -> web.Response:
        state = self.state
        req = await read_request(request, EmbeddingRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        inputs = _inputs(req.input)
        tenant = state.tenant(req.user, "user")
        # refused before any input is tokenized or submitted
        await state.call(_checked(self.engine.embedding_model.check_dimensions, req.dimensions))
        base = f"embd-{uuid.uuid4().hex}"
        rids = [f"{base}-{i}" for i in range(len(inputs))]
        ticket = state.admit()
        try:
            with state.serving(request, base, rids):
                results = await state.call(
                    gather_all(
                        [
                            self.engine.embed(
                                item,
                                dimensions=req.dimensions,
                                truncate_prompt_tokens=req.truncate_prompt_tokens,
                                normalize=req.normalize,
                                rid=rid,
                                tenant=tenant,
                            )
                            for item, rid in zip(inputs, rids, strict=True)
                        ]
                    )
                )
        finally:
            ticket.release()
        encode = _base64 if req.encoding_format == "base64" else list
        tokens = sum(r.prompt_tokens for r in results)
        return json_response(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": encode(r.embedding)}
                    for i, r in enumerate(results)
                ],
                "model": self.engine.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def rerank(self, request: web.Request) -> web.Response:
        state = self.state
        req = await read_request(request, RerankRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        if not req.query:
            raise bad_request("query: the query is empty", param="query")
        if not req.documents:
            raise bad_request("documents: no document to rank", param="documents")
        texts = [d.text if isinstance(d, RerankDocument) else d for d in req.documents]
        base = f"rerank-{uuid.uuid4().hex}"
        ticket = state.admit()
        try:
            with state.serving(request, base, []):
                result = await state.call(
                    self.engine.rerank(
                        req.query,
                        texts,
                        instruction=req.instruction,
                        truncate_prompt_tokens=req.truncate_prompt_tokens,
                    )
                )
        finally:
            ticket.release()
        order = sorted(range(len(texts)), key=lambda i: -result.scores[i])
        if req.top_n is not None:
            order = order[: req.top_n]
        results = []
        for i in order:
            item: dict = {"index": i, "relevance_score": result.scores[i]}
            if req.return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        tokens = result.prompt_tokens
        return json_response(
            {
                "id": base,
                "object": "rerank",
                "model": self.engine.model_name,
                "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


async def _checked(check, *args) -> None:  # a plain check as an awaitable for state.call
    check(*args)
