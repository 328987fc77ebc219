"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin adapter over the generation pipeline: the body becomes a GenerationRequest (system and
messages as chat-template messages, ``tool_use`` blocks as an assistant's ``tool_calls``,
``tool_result`` blocks as ``role: "tool"`` messages, a user message's ``image`` blocks as the
chat route's image parts on a model that takes images (anthropic_images), tools and
``tool_choice`` in the Chat Completions shapes the chat policy reads, ``thinking`` as the
template's ``enable_thinking``), and anthropic_format writes the pipeline's output. Errors on
these routes take Anthropic's shape (anthropic_errors).
"""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from pyserve.engine.errors import ContextLengthExceeded
from pyserve.http import params
from pyserve.http.anthropic_format import MessagesFormat
from pyserve.http.anthropic_images import image_ref
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
from pyserve.http.chat_images import ImageRef
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
            priority=req.priority,
            timeout=req.timeout,
            tenant=state.tenant(req.metadata and req.metadata.user_id, "metadata.user_id"),
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
        images: list[ImageRef] = []
        takes_images = self.engine.takes_images
        for i, message in enumerate(req.messages):
            messages += _template_messages(message, f"messages[{i}]", images, takes_images)
        if takes_images:  # as the chat route renders for a vision model's template
            messages = [_with_parts(m) for m in messages]
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
            images=images,
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


def _unsupported_block(where: str, why: str) -> APIError:
    return bad_request(f"{where}: {why}", param=where, code="unsupported_parameter")


def _refuse_block(block: ContentBlockParam, where: str, takes_images: bool = False) -> APIError:
    kind = block.__struct_config__.tag
    if isinstance(block, ImageBlockParam) and not takes_images:
        return _unsupported_block(where, "this model takes no images (it serves text only)")
    if isinstance(block, DocumentBlockParam):
        return _unsupported_block(where, "document content blocks are not supported")
    return bad_request(f"{where}: a {kind} block cannot be in this message", param=where)


def _template_messages(
    message: MessageParam, where: str, images: list[ImageRef], takes_images: bool
) -> list[dict]:
    """One Anthropic message as chat-template messages (``ChatMessage.as_template_input``);
    the images of its image blocks are added to ``images``, in order. On a model that takes
    images a user message's content is a list of text and ``{"type": "image"}`` parts."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        return [_assistant_message(message.content, where)]
    out: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlockParam):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlockParam) and takes_images:
            images.append(image_ref(block, at))
            parts.append({"type": "image"})
        elif isinstance(block, ToolResultBlockParam):
            if parts:  # blocks keep their order: the text before the result comes first
                out.append(_user_message(parts, takes_images))
                parts = []
            content = _tool_result_text(block, at, takes_images)
            out.append({"role": "tool", "content": content, "tool_call_id": block.tool_use_id})
        else:
            raise _refuse_block(block, at, takes_images)
    if parts or not out:
        out.append(_user_message(parts, takes_images))
    return out


def _user_message(parts: list[dict], as_parts: bool) -> dict:
    if as_parts:
        return {"role": "user", "content": parts}
    return {"role": "user", "content": "".join(part["text"] for part in parts)}


def _with_parts(message: dict) -> dict:
    """A message whose text content is one text part, as vision models' templates take it."""
    content = message["content"]
    if isinstance(content, list) and content:
        return message
    return {**message, "content": [{"type": "text", "text": content or ""}]}


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


def _tool_result_text(block: ToolResultBlockParam, where: str, takes_images: bool) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            if isinstance(part, ImageBlockParam) and takes_images:
                why = "images in a tool_result are not supported: send them in a user message"
                raise _unsupported_block(at, why)
            if not isinstance(part, TextBlockParam):
                raise _refuse_block(part, at, takes_images)
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
