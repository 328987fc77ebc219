"""Request bodies of every POST route, as msgspec Structs.

Decoding a body into one of these validates types and ranges in one pass; a failure becomes a
400 whose ``param`` names the field. ``/openapi.json`` is generated from these types, so the
constraints below are also the published schema. Unknown fields are ignored, with one warning
per name (``bodies.decode``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pyserve.wire.main_to_worker import (
    Count,
    LogitBias,
    MinP,
    Penalty,
    PositiveCount,
    RepetitionPenalty,
    StopTokenIds,
    Temperature,
    TokenId,
    TopLogprobsCount,
    TopP,
)

MAX_N = 16  # choices per prompt; more is a denial-of-service knob, not a feature
MAX_PROMPTS = 64  # prompts in one /v1/completions or /generate batch
MAX_STOP = 16  # stop strings per request
MAX_TOOLS = 128

PositiveInt = PositiveCount
StopString = Annotated[str, Meta(min_length=1, max_length=1024)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)]
TopK = Annotated[int, Meta(ge=-1, lt=2**31)]  # -1 and 0 both mean "disabled"
Seed = Annotated[int, Meta(ge=0, lt=2**63 - MAX_N)]  # choice i of n samples with seed + i
# vLLM's field and convention: lower runs first (--schedule-policy priority only)
Priority = Annotated[int, Meta(ge=-(2**31), lt=2**31)]
# seconds the request may take, queue and generation together (--request-timeout's default)
Timeout = Annotated[float, Meta(gt=0, le=7 * 86400)]
TopLogprobs = TopLogprobsCount
FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class GrammarFields(msgspec.Struct, kw_only=True):
    """SGLang's names for a constraint on the output; at most one of them (and no
    ``response_format`` beside it)."""

    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None


class SamplingFields(GrammarFields, kw_only=True):
    """What chat and legacy completions share: OpenAI's fields plus vLLM/SGLang's extras.

    Fields OpenAI defines that pyserve does not implement are declared too, as ``Unsupported``,
    so that setting one gets a 400 naming it (``params.refuse_unsupported``) instead of being
    ignored. ``user`` changes nothing about the output, as OpenAI documents it (under
    --fairness tenant it names the request's tenant).
    """

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    logit_bias: LogitBias | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None  # names the tenant under --fairness tenant; never the output
    priority: Priority = 0
    timeout: Timeout | None = None


# A field that is refused when present with any value but null (see SamplingFields).
Unsupported = Annotated[Any, Meta(description="not supported: a 400 when set")]


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class RefusalPart(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


class ImageURL(msgspec.Struct):
    url: str  # data:image/...;base64,..., http(s)://... or file://... (http/image_inputs.py)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: ImageURL | str  # a bare URL string, as some clients send it


class AudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    input_audio: msgspec.Raw


class FilePart(msgspec.Struct, tag_field="type", tag="file"):
    file: msgspec.Raw


ContentPart = TextPart | RefusalPart | ImagePart | AudioPart | FilePart


class FunctionCall(msgspec.Struct, kw_only=True):
    name: FunctionName
    arguments: str  # a JSON object as text, as OpenAI sends it


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant's earlier refusal, rendered as its content
    # An assistant's earlier thought, as pyserve (and vLLM) return it, or OpenRouter's name for
    # it: templates that render thoughts (Qwen3, gpt-oss) read it as reasoning_content.
    reasoning_content: str | None = None
    reasoning: str | None = None
    audio: Unsupported = None
    function_call: Unsupported = None

    def as_template_input(self, parts: bool = False) -> dict:
        """The dict a chat template expects: content parts joined into one string, tool calls
        with their arguments as objects (what HF chat templates iterate over). ``parts``: the
        content as a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts
        instead, as vision models' templates take it (``http/chat_images.py``)."""
        content = self.content
        if isinstance(content, list):
            if parts:
                content = [_template_part(part) for part in content]
            else:
                content = "".join(_part_text(part) for part in content)
        if not content and self.refusal:
            content = self.refusal
        if parts and not isinstance(content, list):
            content = [{"type": "text", "text": content or ""}]
        message: dict = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought:
            message["reasoning_content"] = thought
        return message


def _part_text(part: ContentPart) -> str:
    if isinstance(part, TextPart):
        return part.text
    if isinstance(part, RefusalPart):
        return part.refusal
    if isinstance(part, ImagePart):
        raise ValueError("image_url content: this model takes no images (text only)")
    raise ValueError(f"{part.__struct_config__.tag} content is not supported: text only")


def _template_part(part: ContentPart) -> dict:
    if isinstance(part, ImagePart):
        return {"type": "image"}
    return {"type": "text", "text": _part_text(part)}


def _arguments_object(arguments: str) -> object:
    """A call's arguments parsed, as templates expect a mapping; text that is not a JSON
    object is passed on as it came."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class FunctionTool(msgspec.Struct, kw_only=True, tag_field="type", tag="function"):
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    schema: dict | None = None  # None: any JSON object
    strict: bool | None = None


class TextFormat(msgspec.Struct, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaResponseFormat(msgspec.Struct, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=4096)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # passed to the chat template (vLLM's name)
    reasoning_effort: str | None = None  # passed to a chat template that reads it
    modalities: list[str] | None = None  # only ["text"]
    service_tier: str | None = None  # "auto" and "default" only: there is one tier
    # accepted, and change nothing about the output (README, "Request fields")
    metadata: dict | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # OpenAI's, not implemented: a 400 names each one that is set
    audio: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    prediction: Unsupported = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    moderation: Unsupported = None
    prompt_cache_options: Unsupported = None


# A prompt is a string, a list of strings, a list of token ids, or a list of such lists.
# msgspec allows one array type per union, so the list's items are checked after decoding.
Prompt = (
    Annotated[str, Meta(min_length=1)]
    | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]
)


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt
    max_tokens: PositiveInt | None = 16  # the legacy API's default
    logprobs: TopLogprobs | None = None  # how many alternatives per token
    echo: bool = False
    suffix: str | None = None  # not supported: rejected when set
    best_of: PositiveInt | None = None  # only best_of == n is supported


class GenerateSamplingParams(GrammarFields, kw_only=True):
    """SGLang's ``sampling_params`` (the subset pyserve implements)."""

    max_new_tokens: PositiveInt = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    logit_bias: LogitBias | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_new_tokens: Count = 0
    seed: Seed | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """SGLang's native ``/generate``: exactly one of ``text`` and ``input_ids``."""

    text: str | Annotated[list[str], Meta(min_length=1, max_length=MAX_PROMPTS)] | None = None
    input_ids: (
        Annotated[list[TokenId | Annotated[list[TokenId], Meta(min_length=1)]], Meta(min_length=1)]
        | None
    ) = None
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    # images of a text prompt, one per image marker: URLs or bare base64 (generate_images.py)
    image_data: str | Annotated[list[str], Meta(min_length=1)] | None = None
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    priority: Priority = 0
    timeout: Timeout | None = None
    user: str | None = None  # the request's tenant under --fairness tenant (refused otherwise)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    prompt: str
    model: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str


MAX_EMBEDDING_INPUTS = 2048  # inputs in one /v1/embeddings request (OpenAI's limit)
MAX_RERANK_DOCUMENTS = 1024
# vLLM's truncate_prompt_tokens: keep the input's last N tokens (-1: the context's worth)
TruncatePromptTokens = Annotated[int, Meta(ge=-1, lt=2**31)]

# A string, a list of strings, a list of token ids, or a list of lists of them (as Prompt: the
# items are checked after decoding).
EmbeddingInput = (
    str
    | Annotated[
        list[str | TokenId | list[TokenId]], Meta(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    ]
)


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's ``/v1/embeddings``, plus vLLM's ``truncate_prompt_tokens`` and ``normalize``."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None  # a Matryoshka size the model declares
    user: str | None = None  # names the tenant under --fairness tenant; never the output
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    normalize: bool | None = None  # None: the server's --embedding-normalize


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    """Jina's and Cohere's ``/v1/rerank``, plus ``instruction`` (a Qwen3-Reranker-style
    model's task line) and vLLM's ``truncate_prompt_tokens``."""

    query: str
    documents: Annotated[list[str | RerankDocument], Meta(max_length=MAX_RERANK_DOCUMENTS)]
    model: str | None = None
    top_n: PositiveInt | None = None  # None: every document
    return_documents: bool = True
    instruction: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
