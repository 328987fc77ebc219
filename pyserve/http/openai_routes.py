"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Both completion routes share one pipeline: render/tokenize the prompts, start one engine
generation per choice (n per prompt, seeds seed+i), then either collect them into one body or
stream them as SSE. Errors before the first byte of a stream are plain HTTP errors; after it, an
error event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from pyserve.http import params
from pyserve.http.bodies import read_request
from pyserve.http.chat_tools import ChatPlan
from pyserve.http.direct_events import direct_events
from pyserve.http.errors import bad_request, json_response
from pyserve.http.merge import merge_choices
from pyserve.http.metrics import RequestLatencies
from pyserve.http.openai_format import (
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    ResponseMeta,
)
from pyserve.http.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from pyserve.http.sse import SSEStream
from pyserve.http.state import QueueTicket, ServerState, engine_error, next_item
from pyserve.outputs import GenerationChunk
from pyserve.wire.main_to_worker import DetokParams, SamplingParams

log = logging.getLogger("pyserve.http")

Format = ChatFormat | CompletionFormat
Merged = AsyncIterator[tuple[int, GenerationChunk]]


@dataclass
class Job:
    """Everything one OpenAI request asks the engine for: one (prompt, sampling) per choice,
    choice j of prompt i at index i*n + j."""

    meta: ResponseMeta
    choices: list[tuple[list[int], SamplingParams]]
    detok: DetokParams
    stream: bool
    arrival: float

    def rids(self) -> list[str]:
        if len(self.choices) == 1:
            return [self.meta.id]
        return [f"{self.meta.id}-{i}" for i in range(len(self.choices))]


class OpenAIRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)

    # ------------------------------------------------------------------ models

    def _model_card(self) -> dict:
        return {
            "id": self.engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pyserve",
            "root": self.state.model_path(),  # its file or directory, as vLLM and SGLang say
            "max_model_len": self.engine.context_length,
            "capabilities": self.engine.capabilities,  # generate, embed, rerank
        }

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self.state.check_model(request.match_info["model"])
        return json_response(self._model_card())

    # ------------------------------------------------------------------ chat

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        state = self.state
        req = await read_request(request, ChatCompletionRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        params.check_chat_request(req)
        top_logprobs = params.chat_top_logprobs(req)
        plan = ChatPlan.of(req, self.engine)
        messages = plan.template_messages([m.as_template_input() for m in req.messages])
        prompt = await state.call(
            self.engine.apply_chat_template(
                messages,
                chat_template_kwargs=self._template_kwargs(req),
                tools=plan.template_tools,
            )
        )
        plan = plan.for_prompt(prompt, self.engine)
        if plan.grammar is not None:
            await state.call(self.engine.check_grammar(plan.grammar, plan.grammar_param))
        max_new = state.max_new_tokens(len(prompt), params.chat_max_tokens(req))
        meta = self._meta("chatcmpl", req.stream, req.stream_options)
        detok = params.openai_detok(req)
        if plan.keep_special_tokens:
            detok.skip_special_tokens = False
        job = Job(
            meta=meta,
            choices=[
                (
                    prompt,
                    params.openai_sampling(
                        req,
                        max_new_tokens=max_new,
                        choice=i,
                        top_logprobs=top_logprobs,
                        grammar=plan.grammar,
                    ),
                )
                for i in range(req.n)
            ],
            detok=detok,
            stream=req.stream,
            arrival=arrival,
        )
        token_text = state.token_texts if top_logprobs is not None else None
        if state.options.log_requests:
            log.info("%s messages: %r", meta.id, messages)
        return await self._run(request, job, ChatFormat(meta, req.n, token_text, plan.output))

    def _template_kwargs(self, req: ChatCompletionRequest) -> dict:
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            if not self.engine.chat_template_reads("reasoning_effort"):
                raise params.unsupported(
                    "reasoning_effort", "this model's chat template does not read it"
                )
            kwargs["reasoning_effort"] = req.reasoning_effort
        return kwargs

    # ------------------------------------------------------------------ completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        state = self.state
        req = await read_request(request, CompletionRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        params.check_completion_request(req)
        grammar, param = params.request_grammar(req, None)
        if grammar is not None:
            await state.call(self.engine.check_grammar(grammar, param))
        prompts = await self._tokenized_prompts(req.prompt)
        if len(prompts) * req.n > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts × n per request", param="n")
        meta = self._meta("cmpl", req.stream, req.stream_options)
        job = Job(
            meta=meta,
            choices=[
                (
                    prompt,
                    params.openai_sampling(
                        req,
                        max_new_tokens=state.max_new_tokens(len(prompt), req.max_tokens),
                        choice=i,
                        top_logprobs=req.logprobs,
                        grammar=grammar,
                    ),
                )
                for prompt in prompts
                for i in range(req.n)
            ],
            detok=params.openai_detok(req),
            stream=req.stream,
            arrival=arrival,
        )
        echoes = [""] * len(job.choices)
        if req.echo:
            texts = await self._prompt_texts(req.prompt, prompts)
            echoes = [texts[c // req.n] for c in range(len(echoes))]
        token_text = state.token_texts if req.logprobs is not None else None
        if state.options.log_requests:
            log.info("%s prompt: %r", meta.id, req.prompt)
        return await self._run(request, job, CompletionFormat(meta, req.n, echoes, token_text))

    async def _tokenized_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await self.state.call(self.engine.tokenize(prompt))]
        kinds = {type(p) for p in prompt}
        if kinds == {int}:
            return [list(prompt)]
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        if kinds == {str}:
            return [await self.state.call(self.engine.tokenize(p)) for p in prompt]
        if kinds == {list}:
            if not all(prompt):
                raise bad_request("a token-id prompt must not be empty", param="prompt")
            return [list(p) for p in prompt]
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            "token-id lists (not a mixture)",
            param="prompt",
        )

    async def _prompt_texts(self, prompt: str | list, prompts: list[list[int]]) -> list[str]:
        """The prompts as text, for echo: given strings as they came, token ids decoded."""
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        return [await self.state.call(self.engine.detokenize(p)) for p in prompts]

    # ------------------------------------------------------------------ shared pipeline

    def _meta(
        self, prefix: str, stream: bool, stream_options: StreamOptions | None
    ) -> ResponseMeta:
        include_usage = bool(stream and stream_options and stream_options.include_usage)
        return ResponseMeta(
            id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.engine.model_name,
            include_usage=include_usage,
        )

    async def _run(self, request: web.Request, job: Job, fmt: Format) -> web.StreamResponse:
        state = self.state
        rids = job.rids()
        ticket = state.admit()
        try:
            with state.serving(request, job.meta.id, rids):
                streams = [
                    self.engine.generate(prompt, sampling, job.detok, rid)
                    for (prompt, sampling), rid in zip(job.choices, rids, strict=True)
                ]
                latencies = [state.metrics.request(job.arrival) for _ in streams]
                async with contextlib.aclosing(merge_choices(streams, latencies)) as merged:
                    if job.stream:
                        return await self._stream(request, merged, fmt, rids, latencies, ticket)
                    return await self._collect(merged, fmt, len(rids), ticket)
        finally:
            ticket.release()

    async def _collect(
        self, merged: Merged, fmt: Format, count: int, ticket: QueueTicket
    ) -> web.Response:
        results = [ChoiceResult() for _ in range(count)]
        try:
            async for index, chunk in merged:
                ticket.release()
                results[index].add(chunk)
        except Exception as exc:
            raise engine_error(exc) from exc
        if fmt.token_text is not None:
            for result in results:
                self.state.token_texts.resolve_logprobs(result.logprobs)
        if self.state.options.log_requests:
            log.info("%s output: %r", fmt.meta.id, [r.text for r in results])
        return web.Response(body=fmt.response(results), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        merged: Merged,
        fmt: Format,
        rids: list[str],
        latencies: list[RequestLatencies],
        ticket: QueueTicket,
    ) -> web.StreamResponse:
        count = len(rids)
        results = [ChoiceResult() for _ in range(count)]
        opened = [False] * count
        first = await next_item(merged)  # an error here is still a plain HTTP error
        ticket.release()
        sse = SSEStream(request)
        await sse.start()
        if count == 1 and fmt.token_text is None and fmt.stateless:  # see direct_events
            sink = direct_events(sse, fmt, results[0], latencies[0])
            self.engine.stream_directly(rids[0], sink)
        item = first
        try:
            while item is not None:
                index, chunk = item
                results[index].add(chunk)
                if not opened[index]:
                    opened[index] = True
                    for payload in fmt.opening(index):
                        await sse.send(payload)
                if fmt.token_text is not None and chunk.logprobs:
                    self.state.token_texts.resolve_logprobs(chunk.logprobs)
                payload = fmt.content(index, chunk)
                if payload is not None:
                    await sse.send(payload)
                if chunk.finish_reason is not None:
                    for payload in fmt.closing(index, chunk.finish_reason):
                        await sse.send(payload)
                item = await anext(merged, None)
        except ConnectionError:
            raise  # the client is gone: there is nobody to tell
        except Exception as exc:
            await sse.send_error(engine_error(exc))
            return sse.response
        if fmt.meta.include_usage:
            await sse.send(fmt.usage(results))
        if self.state.options.log_requests:
            log.info("%s output: %r", fmt.meta.id, [r.text for r in results])
        return await sse.finish()
