"""The native (SGLang-style) routes: /generate (with ``image_data`` on a vision model),
/tokenize, /detokenize, /abort_request, /flush_cache."""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from pyserve.chat.output import OutputDelta, ParsedMessage
from pyserve.engine.image_prompts import ImagePrompt
from pyserve.http import params
from pyserve.http.bodies import read_body, read_request
from pyserve.http.errors import APIError, bad_request, json_response
from pyserve.http.generate_images import check_image_prompt, image_refs
from pyserve.http.generation import GenerationRequest
from pyserve.http.pipeline import ChoiceResult, Pipeline
from pyserve.http.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from pyserve.http.sse import DONE, event
from pyserve.http.state import ServerState
from pyserve.outputs import GenerationChunk
from pyserve.wire.main_to_worker import ImageInput


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
    if result.spec_accepted_tokens is not None:  # with speculative decoding
        meta["spec_accepted_tokens"] = result.spec_accepted_tokens
    if logprobs:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in result.logprobs]
        meta["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in result.logprobs]
    return {"text": result.text, "output_ids": result.token_ids, "meta_info": meta}


class GenerateFormat:
    """SGLang's /generate bodies: one output per prompt (a list for a batch); a stream sends the
    cumulative text and output ids in every event."""

    token_text = None  # logprobs are written as token ids
    stateless = False
    eager = False

    def __init__(self, rids: list[str], batched: bool, arrival: float, logprobs: bool) -> None:
        self.id = rids[0]
        self.rids = rids
        self.batched = batched
        self.arrival = arrival
        self.logprobs = logprobs
        self._streamed = ChoiceResult()

    def preamble(self) -> list[bytes]:
        return []

    def ping(self) -> bytes | None:
        return None

    def opening(self, index: int) -> list[bytes]:
        return []

    def content(
        self, index: int, chunk: GenerationChunk, delta: OutputDelta | None
    ) -> bytes | None:
        self._streamed.add(chunk)  # a stream has one prompt
        output = _generate_output(self._streamed, self.rids[0], self.arrival, logprobs=False)
        return event(msgspec.json.encode(output))

    def closing(
        self, index: int, result: ChoiceResult, held: OutputDelta | None, finish: str | None
    ) -> list[bytes]:
        return []

    def end(self, results: list[ChoiceResult]) -> list[bytes]:
        return [DONE]

    def error(self, error: APIError) -> list[bytes]:
        return [event(error.body()), DONE]

    def response(self, results: list[ChoiceResult], messages: list[ParsedMessage] | None) -> bytes:
        outputs = [
            _generate_output(r, rid, self.arrival, self.logprobs)
            for r, rid in zip(results, self.rids, strict=True)
        ]
        return msgspec.json.encode(outputs if self.batched else outputs[0])


class NativeRoutes:
    def __init__(self, state: ServerState, pipeline: Pipeline) -> None:
        self.state = state
        self.engine = state.engine
        self.pipeline = pipeline

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/flush_cache", self.flush_cache)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        req = await read_request(request, GenerateRequest, self.state.options.max_body_bytes)
        if req.user is not None and self.engine.config.fairness != "tenant":
            raise params.unsupported("user", "it names a tenant: start with --fairness tenant")
        images: list[ImageInput] = []
        if req.image_data is not None:
            prompt = await self._image_prompt(req)
            prompts, batched, images = [prompt.ids], False, prompt.images
        else:
            prompts, batched = await self._prompts(req)
        if batched and req.stream:
            raise bad_request("stream is supported for a single prompt only", param="stream")
        top = req.top_logprobs_num if req.return_logprob else None
        grammar, param = params.request_grammar(req.sampling_params, None)
        generation = GenerationRequest(
            sampling=params.generate_sampling(req.sampling_params, top),
            prompts=prompts,
            prompt_images=images,
            max_tokens=req.sampling_params.max_new_tokens,
            grammar=grammar,
            grammar_param=f"sampling_params.{param}",
            stream=req.stream,
            priority=req.priority,
            timeout=req.timeout,
            tenant=self.state.tenant(req.user, "user"),
        )
        base = req.rid or uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(prompts))] if batched else [base]
        job = await self.pipeline.prepare(generation, base, rids)
        fmt = GenerateFormat(rids, batched, arrival, req.return_logprob)
        return await self.pipeline.run(request, job, fmt)

    async def _image_prompt(self, req: GenerateRequest) -> ImagePrompt:
        """The text prompt with its ``image_data``, encoded as ``text`` alone would be."""
        assert req.image_data is not None
        refs = image_refs(req.image_data)
        text = check_image_prompt(self.engine.image_marker, req.text, req.input_ids, refs)
        pictures = await self.state.read_images(refs, count_param="image_data")
        return await self.state.call(self.engine.prompt_with_images(text, pictures))

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
