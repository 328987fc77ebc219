"""Request bodies of every POST route, as msgspec Structs.

Decoding a body into one of these validates types and ranges in one pass; a failure becomes a
400 whose ``param`` names the field. ``/openapi.json`` is generated from these types, so the
constraints below are also the published schema. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

MAX_N = 16  # choices per prompt; more is a denial-of-service knob, not a feature
MAX_PROMPTS = 64  # prompts in one /v1/completions or /generate batch
MAX_STOP = 16  # stop strings per request

TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
PositiveInt = Annotated[int, Meta(ge=1, lt=2**31)]
StopString = Annotated[str, Meta(min_length=1, max_length=1024)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)]
Temperature = Annotated[float, Meta(ge=0, le=100)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1, lt=2**31)]  # -1 and 0 both mean "disabled"
MinP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10)]
Seed = Annotated[int, Meta(ge=0, lt=2**63 - MAX_N)]  # choice i of n samples with seed + i
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """What chat and legacy completions share: OpenAI's fields plus vLLM/SGLang's extras."""

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
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, lt=2**31)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None  # accepted, unused


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        """The dict a chat template expects: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=4096)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None


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


class GenerateSamplingParams(msgspec.Struct, kw_only=True):
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
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_new_tokens: Annotated[int, Meta(ge=0, lt=2**31)] = 0
    seed: Seed | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """SGLang's native ``/generate``: exactly one of ``text`` and ``input_ids``."""

    text: str | Annotated[list[str], Meta(min_length=1, max_length=MAX_PROMPTS)] | None = None
    input_ids: (
        Annotated[list[TokenId | Annotated[list[TokenId], Meta(min_length=1)]], Meta(min_length=1)]
        | None
    ) = None
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0


class TokenizeRequest(msgspec.Struct, kw_only=True):
    prompt: str
    model: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str
