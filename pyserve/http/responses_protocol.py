"""The Responses API's request body and input items, and how they become chat-template messages.

``ResponsesRequest`` is decoded by msgspec like every other body (types and ranges in one pass,
unknown fields warned). ``input``, ``tools`` and ``tool_choice`` are unions that OpenAI tells
apart by ``type`` (a message may even omit it), so they are decoded as plain JSON and checked
item by item here: a 400 then names the item (``input[2].content[0].type``) and says whether its
type is unknown or one of OpenAI's that pyserve does not serve (images, built-in tools).

Input items are kept in one normal form, OpenAI's own item shapes as plain dicts: the request's
items once checked, the stored output of an earlier response, and what
``GET /v1/responses/{id}/input_items`` returns. ``template_messages`` turns that list into the
messages a chat template renders.
"""

from __future__ import annotations

import secrets
import string
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pyserve.http.errors import APIError, bad_request, from_validation_error
from pyserve.http.params import unsupported
from pyserve.http.protocol import (
    MAX_TOOLS,
    FunctionDefinition,
    FunctionName,
    FunctionTool,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaResponseFormat,
    NamedFunction,
    NamedToolChoice,
    PositiveInt,
    Priority,
    ResponseFormat,
    TextFormat,
    Timeout,
    ToolChoice,
    Unsupported,
)
from pyserve.wire.main_to_worker import Temperature, TopP

MAX_INPUT_ITEMS = 4096
MAX_METADATA = 16  # OpenAI's limit: 16 pairs, keys up to 64 characters, values up to 512

# ----------------------------------------------------------------------------- request body


class JsonSchemaText(msgspec.Struct, kw_only=True, tag_field="type", tag="json_schema"):
    """``text.format`` for a JSON schema: the Chat Completions ``json_schema`` object, flat."""

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    schema: dict
    description: str | None = None
    strict: bool | None = None


TextFormatConfig = TextFormat | JsonObjectFormat | JsonSchemaText


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormatConfig | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # only "medium": the model's own


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """OpenAI's ``POST /v1/responses`` body (the fields pyserve serves or names in a 400)."""

    input: (
        Annotated[str, Meta(min_length=1)]
        | Annotated[list[dict], Meta(min_length=1, max_length=MAX_INPUT_ITEMS)]
    )
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    tools: Annotated[list[dict], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=MAX_METADATA)] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    priority: Priority = 0  # pyserve's, as on every generation request
    timeout: Timeout | None = None
    background: bool | None = None
    stream_options: dict | None = None  # include_obfuscation: nothing to obfuscate here
    # accepted, and change nothing about the output (README, "Responses API"); user names
    # the tenant under --fairness tenant
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # SGLang's extension (as in chat): generate past the end-of-sequence token
    ignore_eos: bool = False
    # OpenAI's, not implemented: a 400 names each one that is set
    conversation: Unsupported = None
    prompt: Unsupported = None
    max_tool_calls: Unsupported = None
    context_management: Unsupported = None
    moderation: Unsupported = None
    prompt_cache_options: Unsupported = None
    image: Unsupported = None
    background_options: Unsupported = None
    access_programs: Unsupported = None


# What ``include`` may ask for: reasoning items are plain text here, so there is never any
# encrypted content to include (the field stays null).
INCLUDABLE = {"reasoning.encrypted_content"}

# ----------------------------------------------------------------------------- input items


class InputText(msgspec.Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class Refusal(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


ContentPart = InputText | OutputText | Refusal
_PART_TYPES = {"input_text", "output_text", "refusal"}
_OTHER_PART_TYPES = {"input_image", "input_file", "input_audio", "text", "summary_text"}

ItemId = Annotated[str, Meta(max_length=256)]


class MessageItem(msgspec.Struct, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: ItemId | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: FunctionName
    arguments: str
    id: ItemId | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    output: str | list[InputText]
    id: ItemId | None = None
    status: str | None = None


class SummaryText(msgspec.Struct, tag_field="type", tag="summary_text"):
    text: str


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(msgspec.Struct, kw_only=True):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    id: ItemId | None = None
    encrypted_content: str | None = None
    status: str | None = None


_ITEM_TYPES: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
# OpenAI's item types that need a built-in tool, a file store or a stored item reference
_OTHER_ITEM_TYPES = {
    "item_reference", "file_search_call", "computer_call", "computer_call_output",
    "web_search_call", "image_generation_call", "code_interpreter_call", "local_shell_call",
    "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
    "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
    "mcp_call", "custom_tool_call", "custom_tool_call_output", "compaction", "tool_search_call",
    "tool_search_output",
}  # fmt: skip


class ResponsesFunctionTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    defer_loading: Unsupported = None
    output_schema: Unsupported = None
    allowed_callers: Unsupported = None


_ALPHABET = string.ascii_lowercase + string.digits


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: ``resp_``, ``msg_``, ``fc_``, ``rs_`` and random characters."""
    return prefix + "_" + "".join(secrets.choice(_ALPHABET) for _ in range(32))


def _convert(value: object, type_: type, where: str) -> Any:
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        error = from_validation_error(exc)
        path = error.info.param
        error.info.param = where + ("." + path if path and not path.startswith("[") else path or "")
        raise error from None


def input_items(body: str | list[dict]) -> list[dict]:
    """The request's ``input`` checked and in normal form (OpenAI's item shapes, each with an
    id)."""
    if isinstance(body, str):
        body = [{"role": "user", "content": body}]
    items = []
    for i, raw in enumerate(body):
        where = f"input[{i}]"
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind not in _ITEM_TYPES:
            if kind in _OTHER_ITEM_TYPES:
                raise unsupported(f"{where}.type", f"{kind} items (built-in tools are not served)")
            raise bad_request(f"unknown input item type {kind!r}", param=f"{where}.type")
        if kind == "message" and isinstance(raw.get("content"), list):
            _check_part_types(raw["content"], f"{where}.content")
        item = _convert(raw, _ITEM_TYPES[kind], where)
        if isinstance(item, ReasoningItem) and item.encrypted_content is not None:
            raise unsupported(
                f"{where}.encrypted_content", "reasoning here is plain text, never encrypted"
            )
        items.append(_normal_item(item))
    return items


def _check_part_types(parts: list, where: str) -> None:
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _OTHER_PART_TYPES:
            raise unsupported(f"{where}[{j}].type", f"{kind} content: this server takes text only")
        if kind not in _PART_TYPES:
            raise bad_request(f"unknown content part type {kind!r}", param=f"{where}[{j}].type")


def _normal_item(item: Any) -> dict:
    if isinstance(item, MessageItem):
        parts = item.content
        if isinstance(parts, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            content = [{"type": kind, "text": parts}]
        else:
            content = msgspec.to_builtins(parts)
        if item.role == "assistant":
            for part in content:
                if part["type"] == "output_text":
                    part.setdefault("annotations", [])
                    part.setdefault("logprobs", [])
        return {
            "type": "message",
            "id": item.id or new_id("msg"),
            "role": item.role,
            "content": content,
            "status": "completed",
        }
    body = msgspec.to_builtins(item)
    if isinstance(item, FunctionCallItem):
        body["id"] = item.id or new_id("fc")
        body["status"] = "completed"
    elif isinstance(item, FunctionCallOutputItem):
        body["id"] = item.id or new_id("fco")
        body["status"] = "completed"
        if not isinstance(item.output, str):
            body["output"] = "".join(part.text for part in item.output)
    else:
        body["id"] = item.id or new_id("rs")
    return body


def function_tools(tools: list[dict] | None) -> list[FunctionTool]:
    """The request's tools as Chat Completions function tools; built-in tools are refused."""
    out = []
    for i, raw in enumerate(tools or []):
        kind = raw.get("type")
        if kind != "function":
            name = kind if isinstance(kind, str) else repr(kind)
            raise unsupported(
                f"tools[{i}].type", f"the {name} tool (only function tools are served)"
            )
        tool = _convert(raw, ResponsesFunctionTool, f"tools[{i}]")
        for name in ("defer_loading", "output_schema", "allowed_callers"):
            if getattr(tool, name) is not None:
                raise unsupported(f"tools[{i}].{name}")
        definition = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        out.append(FunctionTool(function=definition))
    return out


def tool_choice(value: str | dict | None) -> ToolChoice | None:
    if value is None or value in ("auto", "required", "none"):
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        raise bad_request(
            f"tool_choice {value!r}: expected auto, required, none or a function",
            param="tool_choice",
        )
    kind = value.get("type")
    if kind == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("a function tool_choice needs a name", param="tool_choice.name")
        return NamedToolChoice(function=NamedFunction(name=name))
    raise unsupported("tool_choice", f"{kind!r} (only auto, required, none or a function)")


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    """``text.format`` as the Chat Completions ``response_format`` the chat policy reads."""
    fmt = text.format if text is not None else None
    if isinstance(fmt, JsonSchemaText):
        schema = JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict
        )
        return JsonSchemaResponseFormat(json_schema=schema)
    return fmt


# ----------------------------------------------------------------------------- templates


def template_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The chat-template messages of a conversation in normal form: a function call joins the
    assistant turn before it (or starts one), a reasoning item becomes the next assistant
    turn's ``reasoning_content``, a function's output is a ``tool`` message."""
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    thought: str | None = None
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            message = {"role": role, "content": "".join(map(_part_text, item["content"]))}
            if role == "assistant" and thought is not None:
                message["reasoning_content"], thought = thought, None
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": _arguments(item["arguments"])},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
                if thought is not None:
                    last["reasoning_content"], thought = thought, None
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "".join(part["text"] for part in parts)
    return messages


def _part_text(part: dict) -> str:
    return part["refusal"] if part["type"] == "refusal" else part["text"]


def _arguments(arguments: str) -> object:
    """A call's arguments parsed (templates iterate over a mapping); other text as it came."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def check_request(req: ResponsesRequest) -> None:
    """The fields accepted for some values only."""
    from pyserve.http.params import refuse_unsupported

    refuse_unsupported(req)
    if req.background:
        raise unsupported("background", "responses are generated while the request waits")
    if req.truncation == "auto":
        raise unsupported("truncation", '"disabled" only: a prompt over the context is a 400')
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier", 'there is one tier: "auto" or "default"')
    if req.top_logprobs:
        raise unsupported("top_logprobs")
    for name in req.include or ():
        if name not in INCLUDABLE:
            raise unsupported("include", f"{name!r}")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity", '"medium" only: the model writes as it writes')


def refuse(error: APIError, param: str) -> APIError:
    """``error`` naming ``param`` when it named the chat field the policy knows it by."""
    if error.info.param == "response_format":
        error.info.param = param
    return error
