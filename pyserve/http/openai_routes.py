"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Each completion route parses its body into the pipeline's GenerationRequest and writes the
pipeline's output in OpenAI's shape (openai_format): one engine generation per choice (n per
prompt, seeds seed+i), collected into one body or streamed as SSE.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from pyserve.http import params
from pyserve.http.bodies import read_request
from pyserve.http.chat_images import template_messages
from pyserve.http.errors import bad_request, json_response
from pyserve.http.generation import ChatSpec, GenerationRequest
from pyserve.http.openai_format import ChatFormat, CompletionFormat, ResponseMeta
from pyserve.http.pipeline import Pipeline
from pyserve.http.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from pyserve.http.state import ServerState


class OpenAIRoutes:
    def __init__(self, state: ServerState, pipeline: Pipeline) -> None:
        self.state = state
        self.engine = state.engine
        self.pipeline = pipeline

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
            "modalities": ["text", "image"] if self.engine.takes_images else ["text"],
        }

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self.state.check_model(request.match_info["model"])
        return json_response(self._model_card())

    # ------------------------------------------------------------------ chat

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        req = await read_request(request, ChatCompletionRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        params.check_chat_request(req)
        top_logprobs = params.chat_top_logprobs(req)
        grammar, param = params.request_grammar(req, req.response_format)
        messages, images = template_messages(req.messages, self.engine.takes_images)
        generation = GenerationRequest(
            sampling=params.openai_sampling(req, top_logprobs),
            chat=ChatSpec(
                messages=messages,
                images=images,
                tools=list(req.tools or []),
                tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls,
                response_format=req.response_format,
                template_kwargs=self._template_kwargs(req),
            ),
            max_tokens=params.chat_max_tokens(req),
            n=req.n,
            grammar=grammar,
            grammar_param=param,
            stream=req.stream,
            priority=req.priority,
            timeout=req.timeout,
            tenant=state.tenant(req.user, "user"),
        )
        meta = self._meta("chatcmpl", req.stream, req.stream_options)
        job = await self.pipeline.prepare(generation, meta.id)
        token_text = state.token_texts if top_logprobs is not None else None
        fmt = ChatFormat(meta, req.n, token_text, parsed=job.output is not None)
        return await self.pipeline.run(request, job, fmt)

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
        state = self.state
        req = await read_request(request, CompletionRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        params.check_completion_request(req)
        grammar, param = params.request_grammar(req, None)
        prompts = await self._tokenized_prompts(req.prompt)
        if len(prompts) * req.n > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts × n per request", param="n")
        generation = GenerationRequest(
            sampling=params.openai_sampling(req, req.logprobs),
            prompts=prompts,
            max_tokens=req.max_tokens,
            n=req.n,
            grammar=grammar,
            grammar_param=param,
            stream=req.stream,
            priority=req.priority,
            timeout=req.timeout,
            tenant=state.tenant(req.user, "user"),
        )
        meta = self._meta("cmpl", req.stream, req.stream_options)
        job = await self.pipeline.prepare(generation, meta.id)
        echoes = [""] * len(job.choices)
        if req.echo:
            texts = await self._prompt_texts(req.prompt, prompts)
            echoes = [texts[c // req.n] for c in range(len(echoes))]
        token_text = state.token_texts if req.logprobs is not None else None
        return await self.pipeline.run(
            request, job, CompletionFormat(meta, req.n, echoes, token_text)
        )

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
