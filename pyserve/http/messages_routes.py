"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin adapter over the generation pipeline: the body becomes a GenerationRequest (system and
messages as chat-template messages, ``tool_use`` blocks as an assistant's ``tool_calls``,
``tool_result`` blocks as ``role: "tool"`` messages, tools and ``tool_choice`` in the Chat
Completions shapes the chat policy reads, ``thinking`` as the template's ``enable_thinking``),
and anthropic_format writes the pipeline's output. Errors on these routes take Anthropic's
shape (anthropic_errors).
"""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from pyserve.engine.errors import ContextLengthExceeded
from pyserve.http import params
from pyserve.http.anthropic_format import MessagesFormat
from pyserve.http.anthropic_protocol import (
    ContentBlockParam,
    CountTokensRequest,
    DocumentBlockParam,
    ImageBlockParam,
    MessageParam,
    MessagesPrompt,
    MessagesRequest,
    MessagesToolChoice,
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingAdaptive,
    ThinkingBlockParam,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from pyserve.http.bodies import read_request
from pyserve.http.errors import APIError, bad_request, json_response
from pyserve.http.generation import ChatSpec, GenerationRequest, Sampling
from pyserve.http.pipeline import Job, Pipeline
from pyserve.http.protocol import (
    FunctionDefinition,
    FunctionTool,
    JsonSchemaFormat,
    JsonSchemaResponseFormat,
    NamedFunction,
    NamedToolChoice,
    ToolChoice,
)
from pyserve.http.state import ServerState, engine_error
from pyserve.wire.main_to_worker import Grammar


class MessagesRoutes:
    def __init__(self, state: ServerState, pipeline: Pipeline) -> None:
        self.state = state
        self.engine = state.engine
        self.pipeline = pipeline

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        req = await read_request(request, MessagesRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        if req.service_tier not in (None, "auto", "standard_only"):
            raise params.unsupported("service_tier", 'there is one tier: "auto" or "standard_only"')
        generation = GenerationRequest(
            sampling=Sampling(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                stop=list(req.stop_sequences or []),
            ),
            chat=self._chat_spec(req),
            max_tokens=req.max_tokens,
            stream=req.stream,
        )
        _constrain(generation, req)
        id = f"msg_{uuid.uuid4().hex}"
        job = await self.pipeline.prepare(generation, id)
        self._check_context(job)
        fmt = MessagesFormat(
            id, self.engine.model_name, len(job.prompt_tokens[0]), parsed=job.output is not None
        )
        return await self.pipeline.run(request, job, fmt)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens as ``/v1/messages`` renders it (tools and their instructions
        included); nothing is generated."""
        state = self.state
        req = await read_request(request, CountTokensRequest, state.options.max_body_bytes)
        state.check_model(req.model)
        generation = GenerationRequest(sampling=Sampling(), chat=self._chat_spec(req), max_tokens=1)
        _constrain(generation, req)  # a format that cannot be enforced is refused here too
        job = await self.pipeline.prepare(generation, f"count-{uuid.uuid4().hex}")
        return json_response({"input_tokens": len(job.prompt_tokens[0])})

    def _check_context(self, job: Job) -> None:
        """A prompt and max_tokens beyond the context are refused before the stream opens (an
        eager stream would otherwise report it as an error event)."""
        limit = self.engine.context_length
        for prompt, sampling in job.choices:
            if len(prompt) + sampling.max_new_tokens > limit:
                exc = ContextLengthExceeded(len(prompt), sampling.max_new_tokens, limit)
                raise engine_error(exc)

    # ------------------------------------------------------------------ the request

    def _chat_spec(self, req: MessagesPrompt) -> ChatSpec:
        params.refuse_unsupported(req)
        if req.messages[-1].role == "assistant":
            raise params.unsupported(
                "messages", "a final assistant message (a prefilled answer) cannot be continued"
            )
        messages: list[dict] = []
        system = _system_text(req.system)
        if system:
            messages.append({"role": "system", "content": system})
        for i, message in enumerate(req.messages):
            messages += _template_messages(message, f"messages[{i}]")
        enable_thinking = None
        thinking = req.thinking
        if thinking is not None and not isinstance(thinking, ThinkingAdaptive):
            enable_thinking = isinstance(thinking, ThinkingEnabled)
            self.pipeline.check_thinking(enable_thinking, "thinking")
        if getattr(thinking, "display", None) not in (None, "summarized"):
            raise params.unsupported("thinking.display", "thoughts are shown as written")
        tool_choice, parallel = _tool_choice(req.tool_choice)
        return ChatSpec(
            messages=messages,
            tools=_tools(req),
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            response_format=_response_format(req),
            template_kwargs=self._template_kwargs(req),
            enable_thinking=enable_thinking,
        )

    def _template_kwargs(self, req: MessagesPrompt) -> dict:
        effort = req.output_config.effort if req.output_config is not None else None
        if effort is None:
            return {}
        if not self.engine.chat_template_reads("reasoning_effort"):
            raise params.unsupported(
                "output_config.effort", "this model's chat template reads no reasoning effort"
            )
        return {"reasoning_effort": effort}


def _constrain(generation: GenerationRequest, req: MessagesPrompt) -> None:
    """The grammar of the answer's format, if the request sets one."""
    assert generation.chat is not None
    response_format = generation.chat.response_format
    if isinstance(response_format, JsonSchemaResponseFormat):
        schema = msgspec.json.encode(response_format.json_schema.schema).decode()
        generation.grammar = Grammar("json_schema", schema)
        generation.grammar_param = (
            "output_format" if req.output_format is not None else "output_config.format"
        )


def _response_format(req: MessagesPrompt) -> JsonSchemaResponseFormat | None:
    """Structured outputs (``output_config.format``, or the beta's ``output_format``) in the
    Chat Completions shape that the chat policy reads."""
    config_format = req.output_config.format if req.output_config is not None else None
    if config_format is not None and req.output_format is not None:
        raise bad_request(
            "output_format and output_config.format both set the answer's format: give one",
            param="output_format",
        )
    chosen = config_format or req.output_format
    if chosen is None:
        return None
    return JsonSchemaResponseFormat(JsonSchemaFormat(name="output", schema=chosen.schema))


def _system_text(system: str | list[TextBlockParam] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "".join(block.text for block in system)


def _refuse_block(block: ContentBlockParam, where: str) -> APIError:
    kind = block.__struct_config__.tag
    if isinstance(block, ImageBlockParam | DocumentBlockParam):
        why = f"{kind} content blocks are not supported by this server: it takes text only"
        return bad_request(f"{where}: {why}", param=where, code="unsupported_parameter")
    return bad_request(f"{where}: a {kind} block cannot be in this message", param=where)


def _template_messages(message: MessageParam, where: str) -> list[dict]:
    """One Anthropic message as chat-template messages (``ChatMessage.as_template_input``)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        return [_assistant_message(message.content, where)]
    out: list[dict] = []
    text: list[str] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            text.append(block.text)
        elif isinstance(block, ToolResultBlockParam):
            if text:  # blocks keep their order: the text before the result comes first
                out.append({"role": "user", "content": "".join(text)})
                text = []
            content = _tool_result_text(block, f"{where}.content[{j}]")
            out.append({"role": "tool", "content": content, "tool_call_id": block.tool_use_id})
        else:
            raise _refuse_block(block, f"{where}.content[{j}]")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_message(blocks: list[ContentBlockParam], where: str) -> dict:
    text, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlockParam):
            text.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ThinkingBlockParam):
            thoughts.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlockParam):  # opaque: nothing to render
            raise _refuse_block(block, f"{where}.content[{j}]")
    message: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:  # the name the templates that render earlier thoughts read
        message["reasoning_content"] = "".join(thoughts)
    return message


def _tool_result_text(block: ToolResultBlockParam, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, TextBlockParam):
                raise _refuse_block(part, f"{where}.content[{k}]")
            parts.append(part.text)
        text = "".join(parts)
    # Templates have no place for a failed call: the result says so in words.
    return f"Error: {text}" if block.is_error else text


def _tools(req: MessagesPrompt) -> list[FunctionTool]:
    tools, names = [], set()
    for i, tool in enumerate(req.tools or []):
        where = f"tools[{i}]"
        if tool.type not in (None, "custom"):
            raise params.unsupported(
                f"{where}.type", f"{tool.type!r}: this server runs client tools only"
            )
        schema = tool.input_schema
        if schema is None:
            raise bad_request(f"{where}.input_schema: a tool needs one", param=where)
        if schema.get("type") != "object":
            raise bad_request(
                f'{where}.input_schema: the input is an object ({{"type": "object", ...}})',
                param=f"{where}.input_schema",
            )
        if tool.name in names:
            raise bad_request(f"{where}.name: {tool.name!r} is given twice", param=where)
        names.add(tool.name)
        function = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=schema, strict=tool.strict
        )
        tools.append(FunctionTool(function=function))
    return tools


def _tool_choice(choice: MessagesToolChoice | None) -> tuple[ToolChoice | None, bool | None]:
    """Anthropic's tool_choice as the chat policy's, and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    if isinstance(choice, ToolChoiceNone):
        return "none", None
    parallel = False if choice.disable_parallel_tool_use else None
    if isinstance(choice, ToolChoiceAuto):
        return "auto", parallel
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    return NamedToolChoice(function=NamedFunction(choice.name)), False
