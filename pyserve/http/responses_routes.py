"""OpenAI's Responses API: ``POST /v1/responses`` and the stored responses behind it.

``create`` parses the body (responses_protocol) into the pipeline's GenerationRequest: the
conversation is the stored one of ``previous_response_id`` (if any) followed by ``input``,
rendered after ``instructions``; tools, ``tool_choice`` and ``text.format`` become their Chat
Completions forms, which the chat policy reads. The pipeline's output is written by
``ResponsesFormat``; with ``store`` (OpenAI's default) the finished response is kept
(responses_store) for ``previous_response_id``, ``GET``, ``input_items`` and ``DELETE``.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from pyserve.http import params
from pyserve.http.bodies import read_request
from pyserve.http.errors import APIError, bad_request, json_response
from pyserve.http.generation import ChatSpec, GenerationRequest, Sampling
from pyserve.http.pipeline import Pipeline
from pyserve.http.protocol import GrammarFields
from pyserve.http.responses_format import ResponseMeta, ResponsesFormat
from pyserve.http.responses_protocol import (
    ResponsesRequest,
    check_request,
    function_tools,
    input_items,
    new_id,
    refuse,
    response_format,
    template_messages,
    tool_choice,
)
from pyserve.http.responses_store import Record, ResponseStore, owner_of
from pyserve.http.state import ServerState

MAX_LISTED = 100  # input items a page


def not_found(id: str) -> APIError:
    return APIError(
        404,
        f"No response with id '{id}' found (it was never stored, was evicted or deleted, "
        "or another API key made it).",
        param="response_id",
        code="response_not_found",
    )


class ResponsesRoutes:
    def __init__(self, state: ServerState, pipeline: Pipeline, store: ResponseStore) -> None:
        self.state = state
        self.engine = state.engine
        self.pipeline = pipeline
        self.store = store

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_get("/v1/responses/{id}/input_items", self.list_input_items)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)

    def _owner(self, request: web.Request) -> str:
        """Who may see what this request stores: the API key it came with (the auth middleware
        has checked that it is the server's), none on a server without one."""
        return owner_of(self.state.options.api_key)

    # ------------------------------------------------------------------ create

    async def create(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        req = await read_request(request, ResponsesRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        check_request(req)
        items = input_items(req.input)
        tools = function_tools(req.tools)
        choice = tool_choice(req.tool_choice)
        fmt_spec = response_format(req.text)
        owner = self._owner(request)
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = await self.store.get(req.previous_response_id, owner)
            if previous is None:
                raise not_found(req.previous_response_id)
            history = previous.conversation()
        grammar, _ = params.request_grammar(GrammarFields(), fmt_spec)
        spec = ChatSpec(
            messages=template_messages(req.instructions, [*history, *items]),
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=fmt_spec,
            template_kwargs={},
        )
        self._reasoning(req, spec)
        generation = GenerationRequest(
            sampling=Sampling(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                ignore_eos=req.ignore_eos,
            ),
            chat=spec,
            max_tokens=req.max_output_tokens,
            grammar=grammar,
            grammar_param="response_format",  # the chat policy's name for text.format
            stream=req.stream,
            priority=req.priority,
            timeout=req.timeout,
            tenant=self.state.tenant(req.user, "user"),
        )
        meta = ResponseMeta(
            id=new_id("resp"),
            created_at=int(time.time()),
            model=self.engine.model_name,
            settings=_settings(req, stored=req.store and self.store.enabled),
        )
        try:
            job = await self.pipeline.prepare(generation, meta.id)
        except APIError as error:
            raise refuse(error, "text.format") from None
        on_done = None
        if req.store and self.store.enabled:

            def on_done(response: dict) -> None:
                record = Record(response, items, history, req.instructions)
                self.store.put(meta.id, owner, record)

        fmt = ResponsesFormat(meta, parsed=job.output is not None, on_done=on_done)
        return await self.pipeline.run(request, job, fmt)

    def _reasoning(self, req: ResponsesRequest, spec: ChatSpec) -> None:
        """``reasoning.effort``: to a template that reads it, and as the thought's switch
        (``none``: off) where the server reads thoughts. A thought asked of a server that can
        neither pass the effort on nor read a thought is refused."""
        effort = req.reasoning.effort if req.reasoning is not None else None
        if effort is None:
            return
        reads_effort = self.engine.chat_template_reads("reasoning_effort")
        if reads_effort:
            spec.template_kwargs["reasoning_effort"] = effort
        if effort == "none":
            spec.enable_thinking = False
        elif self.pipeline.policy.reads_thoughts:
            spec.enable_thinking = True
        elif not reads_effort:
            raise params.unsupported(
                "reasoning.effort",
                "this server reads no thoughts (start it with --reasoning-parser) and the "
                "model's chat template reads no reasoning_effort",
            )

    # ------------------------------------------------------------------ stored responses

    async def _record(self, request: web.Request) -> tuple[str, Record]:
        id = request.match_info["id"]
        record = await self.store.get(id, self._owner(request))
        if record is None:
            raise not_found(id)
        return id, record

    async def retrieve(self, request: web.Request) -> web.Response:
        if request.query.get("stream") not in (None, "false"):
            raise params.unsupported("stream", "a stored response is returned whole")
        _, record = await self._record(request)
        return json_response(record.response)

    async def delete(self, request: web.Request) -> web.Response:
        id = request.match_info["id"]
        if not await self.store.delete(id, self._owner(request)):
            raise not_found(id)
        return json_response({"id": id, "object": "response", "deleted": True})

    async def list_input_items(self, request: web.Request) -> web.Response:
        _, record = await self._record(request)
        query = request.query
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", param="order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LISTED:
            raise bad_request(f"limit must be an integer from 1 to {MAX_LISTED}", param="limit")
        items = list(record.input) if order == "asc" else record.input[::-1]
        for name in ("after", "before"):
            at = query.get(name)
            if at is not None:
                ids = [item["id"] for item in items]
                if at not in ids:
                    raise bad_request(f"no input item with id {at!r}", param=name)
                cut = ids.index(at)
                items = items[cut + 1 :] if name == "after" else items[:cut]
        page = items[:limit]
        return json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    async def cancel(self, request: web.Request) -> web.Response:
        raise params.unsupported(
            "cancel", "only background responses can be cancelled, and background is not served"
        )


def _settings(req: ResponsesRequest, stored: bool) -> dict:
    """The request's settings as a response object echoes them."""
    text = {"format": {"type": "text"}, "verbosity": "medium"}
    if req.text is not None and req.text.format is not None:
        text["format"] = msgspec.to_builtins(req.text.format)
    reasoning = {"effort": None, "summary": None}
    if req.reasoning is not None:
        summary = req.reasoning.summary or req.reasoning.generate_summary
        reasoning = {"effort": req.reasoning.effort, "summary": summary}
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": reasoning,
        "service_tier": "default",
        "store": stored,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [_tool_echo(t) for t in req.tools or []],
        "top_logprobs": 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _tool_echo(tool: dict) -> dict:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }
