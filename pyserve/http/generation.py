"""The one internal request that every API dialect's body is parsed into.

Chat Completions, legacy Completions, SGLang's /generate, the Responses API and Anthropic's
Messages API each read their own body and fill a ``GenerationRequest``: the prompt (chat
messages to render, or token ids), the sampling and stop settings with the dialect's defaults
already applied, the constraint on the output, and how many choices. ``pipeline.Pipeline`` takes
it from there. Tools and response formats use the Chat Completions shapes (``protocol``), the
common tongue the chat policy (``chat_tools.ChatPlan``) reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyserve.http.chat_images import ImageRef
from pyserve.http.protocol import FunctionTool, ResponseFormat, ToolChoice
from pyserve.wire.main_to_worker import DetokParams, Grammar, ImageInput, SamplingParams


@dataclass
class Sampling:
    """How each token is drawn and when the output stops (defaults: the engine's own)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # choice i of n samples with seed + i
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None  # None: no logprobs; else the alternatives per token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def params(
        self, *, max_new_tokens: int, choice: int = 0, grammar: Grammar | None = None
    ) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=None if self.seed is None else self.seed + choice,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.top_logprobs is not None,
            top_logprobs=self.top_logprobs or 0,
            logit_bias=dict(self.logit_bias),
            grammar=grammar,
        )

    def detok(self) -> DetokParams:
        return DetokParams(
            stop=list(self.stop),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


@dataclass
class ChatSpec:
    """A conversation to render with the model's chat template, and what its answer may be."""

    messages: list[dict]  # chat-template input: role, content text, tool_calls, tool_call_id
    tools: list[FunctionTool] = field(default_factory=list)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    template_kwargs: dict = field(default_factory=dict)
    # The request's own switch for a reasoning model's thought (Anthropic's ``thinking``,
    # the Responses API's ``reasoning``): None leaves the template's default.
    enable_thinking: bool | None = None
    images: list[ImageRef] = field(default_factory=list)  # the image parts, in order


@dataclass
class GenerationRequest:
    """What one API request asks the engine for, whatever its dialect."""

    sampling: Sampling
    chat: ChatSpec | None = None  # a conversation, or:
    prompts: list[list[int]] | None = None  # token-id prompts (completions, /generate)
    # the images of a single token-id prompt, already encoded (/generate's image_data)
    prompt_images: list[ImageInput] = field(default_factory=list)
    max_tokens: int | None = None  # None: all the room the context leaves
    n: int = 1  # choices per prompt
    grammar: Grammar | None = None  # a constraint on the answer (beside any tools)
    grammar_param: str = "grammar"  # the request field it came from, for errors
    stream: bool = False
    priority: int = 0  # lower runs first (--schedule-policy priority)
    timeout: float | None = None  # seconds, queue and generation (None: --request-timeout)
    tenant: str | None = None  # whose request (--fairness tenant; None: the anonymous tenant)
