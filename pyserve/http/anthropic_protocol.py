"""Anthropic's Messages API request bodies (``/v1/messages``, ``/v1/messages/count_tokens``),
as msgspec Structs.

Content blocks are a tagged union on ``type``: a block of another type is a 400 naming it.
Image and document blocks are decoded whatever their source holds: the route refuses them by
name (a document, an image on a text-only model) or checks an image's source itself
(anthropic_images). ``cache_control`` and ``citations`` are accepted wherever Anthropic allows them:
prefix caching is automatic, and an earlier answer's citations change nothing about the next.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pyserve.http.protocol import (
    MAX_STOP,
    MAX_TOOLS,
    FunctionName,
    Priority,
    StopString,
    Timeout,
    TopK,
    Unsupported,
)
from pyserve.wire.main_to_worker import PositiveCount, Temperature, TopP

MAX_MESSAGES = 4096


class TextBlockParam(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str
    cache_control: dict | None = None
    citations: Any = None


class ImageBlockParam(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    source: Any = None  # checked by the route (anthropic_images), or the block refused
    cache_control: dict | None = None


class DocumentBlockParam(msgspec.Struct, tag_field="type", tag="document", kw_only=True):
    source: Any = None  # refused by the route, whatever it holds


class ToolUseBlockParam(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: FunctionName
    input: dict
    cache_control: dict | None = None


# What a tool_result may hold: text (images and documents are refused by name)
ToolResultContent = TextBlockParam | ImageBlockParam | DocumentBlockParam


class ToolResultBlockParam(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: Annotated[str, Meta(min_length=1, max_length=256)]
    content: str | list[ToolResultContent] | None = None
    is_error: bool = False
    cache_control: dict | None = None


class ThinkingBlockParam(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None  # ours are empty; another server's are not checked


class RedactedThinkingBlockParam(
    msgspec.Struct, tag_field="type", tag="redacted_thinking", kw_only=True
):
    data: str  # encrypted by another server: nothing to render


ContentBlockParam = (
    TextBlockParam
    | ImageBlockParam
    | DocumentBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
)


class MessageParam(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlockParam], Meta(max_length=4096)]


class ToolParam(msgspec.Struct, kw_only=True):
    """A client tool. Anthropic's server tools (``bash_...``, ``web_search_...``) carry another
    ``type`` and are refused by the route."""

    name: FunctionName
    description: str | None = None
    input_schema: dict | None = None  # required for a client tool (checked by the route)
    type: str | None = None  # None or "custom"
    cache_control: dict | None = None
    strict: bool | None = None  # its calls follow input_schema exactly, or the request fails


class ToolChoiceAuto(msgspec.Struct, tag_field="type", tag="auto", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(msgspec.Struct, tag_field="type", tag="any", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(msgspec.Struct, tag_field="type", tag="tool", kw_only=True):
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(msgspec.Struct, tag_field="type", tag="none", kw_only=True):
    pass


MessagesToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled", kw_only=True):
    # Anthropic's lower bound; the thought and the answer share max_tokens (README)
    budget_tokens: Annotated[int, Meta(ge=1024)]
    display: str | None = None  # "summarized" (the thought as written) only


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled", kw_only=True):
    pass


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive", kw_only=True):
    """The model decides whether to think: the chat template's default."""

    display: str | None = None  # "summarized" (the thought as written) only


ThinkingConfig = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class MessagesMetadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None  # names the tenant under --fairness tenant; never the output


class JsonOutputFormat(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    """Structured outputs: the answer is JSON under ``schema``, enforced by a grammar."""

    schema: dict


class OutputConfig(msgspec.Struct, kw_only=True):
    format: JsonOutputFormat | None = None
    effort: str | None = None  # passed to a chat template that reads reasoning_effort


class MessagesPrompt(msgspec.Struct, kw_only=True):
    """What a Messages request and a token count share: the prompt and its tools."""

    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[MessageParam], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlockParam] | None = None
    tools: Annotated[list[ToolParam], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: dict | None = None  # accepted: prefix caching is automatic
    # Anthropic's, not implemented: a 400 names each one that is set
    mcp_servers: Unsupported = None
    container: Unsupported = None
    context_management: Unsupported = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's name


class MessagesRequest(MessagesPrompt, kw_only=True):
    max_tokens: PositiveCount
    stop_sequences: Annotated[list[StopString], Meta(max_length=MAX_STOP)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: MessagesMetadata | None = None
    service_tier: str | None = None  # "auto" and "standard_only": there is one tier
    priority: Priority = 0  # pyserve's, as on every generation request
    timeout: Timeout | None = None


class CountTokensRequest(MessagesPrompt, kw_only=True):
    pass
