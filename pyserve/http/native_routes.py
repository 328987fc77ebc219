"""The native (SGLang-style) routes: /generate, /tokenize, /detokenize, /abort_request,
/flush_cache."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from pyserve.http import params
from pyserve.http.bodies import read_body, read_request
from pyserve.http.errors import bad_request, json_response
from pyserve.http.merge import merge_choices
from pyserve.http.openai_format import ChoiceResult
from pyserve.http.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from pyserve.http.sse import SSEStream
from pyserve.http.state import ServerState, engine_error, next_item
from pyserve.outputs import GenerationChunk

log = logging.getLogger("pyserve.http")


def _finish_reason(result: ChoiceResult) -> dict | None:
    """SGLang's shape: {"type": "stop", "matched": …} or {"type": "length", "length": …}."""
    reason = result.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": result.completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": result.matched_stop}
    return {"type": reason}


def _generate_output(result: ChoiceResult, rid: str, arrival: float, logprobs: bool) -> dict:
    meta = {
        "id": rid,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "finish_reason": _finish_reason(result),
        "e2e_latency": time.perf_counter() - arrival,
    }
    if logprobs:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in result.logprobs]
        meta["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in result.logprobs]
    return {"text": result.text, "output_ids": result.token_ids, "meta_info": meta}


class NativeRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/flush_cache", self.flush_cache)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        state = self.state
        req = await read_request(request, GenerateRequest, state.options.max_body_bytes)
        prompts, batched = await self._prompts(req)
        if batched and req.stream:
            raise bad_request("stream is supported for a single prompt only", param="stream")
        top = req.top_logprobs_num if req.return_logprob else None
        grammar, param = params.request_grammar(req.sampling_params, None)
        if grammar is not None:
            await state.call(self.engine.check_grammar(grammar, f"sampling_params.{param}"))
        sampling = params.generate_sampling(req.sampling_params, top, grammar)
        detok = params.generate_detok(req.sampling_params)
        base = req.rid or uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(prompts))] if batched else [base]
        if state.options.log_requests:
            log.info("%s generate: %r", base, req.text if req.text is not None else req.input_ids)
        ticket = state.admit()
        try:
            with state.serving(request, base, rids):
                streams = [
                    self.engine.generate(p, sampling, detok, rid)
                    for p, rid in zip(prompts, rids, strict=True)
                ]
                latencies = [state.metrics.request(arrival) for _ in streams]
                async with contextlib.aclosing(merge_choices(streams, latencies)) as merged:
                    first = await next_item(merged)  # an error here is a plain HTTP error
                    ticket.release()
                    if req.stream:
                        return await self._stream(request, merged, first, base, arrival)
                    results = [ChoiceResult() for _ in prompts]
                    item = first
                    while item is not None:
                        results[item[0]].add(item[1])
                        item = await next_item(merged)
        finally:
            ticket.release()
        outputs = [
            _generate_output(r, rid, arrival, req.return_logprob)
            for r, rid in zip(results, rids, strict=True)
        ]
        if state.options.log_requests:
            log.info("%s output: %r", base, [r.text for r in results])
        return json_response(outputs if batched else outputs[0])

    async def _stream(
        self,
        request: web.Request,
        merged: AsyncIterator[tuple[int, GenerationChunk]],
        first: tuple[int, GenerationChunk] | None,
        rid: str,
        arrival: float,
    ) -> web.StreamResponse:
        """SGLang streams the cumulative text and output ids in every event."""
        result = ChoiceResult()
        sse = SSEStream(request)
        await sse.start()
        item = first
        try:
            while item is not None:
                result.add(item[1])
                output = _generate_output(result, rid, arrival, logprobs=False)
                await sse.send(msgspec.json.encode(output))
                item = await anext(merged, None)
        except ConnectionError:
            raise  # the client is gone: there is nobody to tell
        except Exception as exc:
            await sse.send_error(engine_error(exc))
            return sse.response
        return await sse.finish()

    async def _prompts(self, req: GenerateRequest) -> tuple[list[list[int]], bool]:
        """The prompts as token ids, and whether the request was a batch."""
        if (req.text is None) == (req.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", param="text")
        if isinstance(req.text, str):
            return [await self.state.call(self.engine.tokenize(req.text))], False
        if req.text is not None:
            return [await self.state.call(self.engine.tokenize(t)) for t in req.text], True
        ids = req.input_ids
        assert ids is not None
        if all(isinstance(t, int) for t in ids):
            return [list(ids)], False
        if all(isinstance(t, list) for t in ids):
            return [list(t) for t in ids], True
        raise bad_request(
            "input_ids must be a list of ids or a list of id lists", param="input_ids"
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await read_request(request, TokenizeRequest, self.state.options.max_body_bytes)
        self.state.check_model(req.model)
        tokens = await self.state.call(self.engine.tokenize(req.prompt))
        return json_response(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.context_length}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await read_request(request, DetokenizeRequest, self.state.options.max_body_bytes)
        self.state.check_model(req.model)
        text = await self.state.call(self.engine.detokenize(req.tokens))
        return json_response({"prompt": text})

    async def abort_request(self, request: web.Request) -> web.Response:
        req = await read_request(request, AbortRequest, self.state.options.max_body_bytes)
        return json_response({"rid": req.rid, "aborted": self.state.abort(req.rid)})

    async def flush_cache(self, request: web.Request) -> web.Response:
        await read_body(request, self.state.options.max_body_bytes)  # any body is ignored
        released = await self.state.call(self.engine.flush_cache())
        return json_response({"flushed": True, "released_blocks": released})
