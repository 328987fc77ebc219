"""One choice's generated text read as an assistant turn: thought, content, tool calls.

A reasoning parser splits ``<think>...</think>`` off as the reasoning; a tool-call parser turns
the format's call blocks into calls (and a "stop" into "tool_calls"), and the generic format's
reply object into its text. A harmony model's output (gpt-oss) is read by the harmony reader
alone, whose channels carry all three. Whole outputs become a ``ParsedMessage``; streamed, each
generated chunk becomes an ``OutputDelta`` carrying whichever of the three it advanced, and text
that may still turn out to be a marker is held back. Every API dialect writes these in its own
shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyserve.chat.harmony import HarmonyFormat, HarmonyStream
from pyserve.chat.reasoning import ReasoningParser, ReasoningStream
from pyserve.chat.tool_calls import ToolCallParser
from pyserve.chat.tool_stream import ToolCall, ToolCallDelta, ToolCallStream


@dataclass
class ParsedMessage:
    """A whole output as an assistant turn."""

    content: str | None  # None: nothing but tool calls
    reasoning: str | None = None  # None: no thought (or no reasoning parser)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class OutputDelta:
    """What one piece of generated text advanced."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass(frozen=True)
class ChatOutput:
    """How one request's choices are read; None parts are off."""

    tools: ToolCallParser | None = None
    reasoning: ReasoningParser | None = None
    harmony: HarmonyFormat | None = None  # set: it reads the whole turn, the others are unused

    def message(self, text: str, finish_reason: str | None) -> ParsedMessage:
        """The assistant turn of a whole output, and its finish reason."""
        if self.harmony is not None:
            return _harmony_message(self.harmony, text, finish_reason)
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text)
        message = ParsedMessage(content, reasoning, finish_reason=finish_reason)
        if self.tools is not None and content:
            parsed = self.tools.parse(content)
            # The content may change without calls: the generic format's reply is the string
            # inside its object. Beside calls, no content is None (OpenAI's null).
            message.content = parsed.content or (None if parsed.tool_calls else "")
            if parsed.tool_calls:
                message.tool_calls = parsed.tool_calls
                message.finish_reason = with_tool_calls(finish_reason)
        return message

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    def __init__(self, output: ChatOutput) -> None:
        self._harmony: HarmonyStream | None = (
            output.harmony.stream() if output.harmony is not None else None
        )
        self._reasoning: ReasoningStream | None = (
            output.reasoning.stream() if output.reasoning is not None else None
        )
        self._tools: ToolCallStream | None = (
            output.tools.stream() if output.tools is not None else None
        )
        self.called = False  # a tool call has been sent

    def feed(self, text: str) -> OutputDelta | None:
        """The delta for the next piece of generated text, or None if it holds nothing yet."""
        return self._delta(text, final=False)

    def finish(self) -> OutputDelta | None:
        """The delta of what was held back, at the end of the output."""
        return self._delta("", final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        return with_tool_calls(reason) if self.called else reason

    def _delta(self, text: str, final: bool) -> OutputDelta | None:
        if self._harmony is not None:
            read = self._harmony.finish() if final else self._harmony.feed(text)
            self.called = self.called or bool(read.tool_calls)
            delta = OutputDelta(read.content, read.reasoning, read.tool_calls)
            return delta if delta else None
        thought, content = "", text
        if self._reasoning is not None:
            thought, content = self._reasoning.finish() if final else self._reasoning.feed(text)
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content) if content else ("", [])
            if final:
                more, late = self._tools.finish()
                content, calls = content + more, calls + late
        if calls:
            self.called = True
        delta = OutputDelta(content, thought, calls)
        return delta if delta else None


def _harmony_message(fmt: HarmonyFormat, text: str, finish_reason: str | None) -> ParsedMessage:
    read = fmt.parse(text)
    # OpenAI's null content beside calls or a thought; an output with nothing is "".
    content = read.content or (None if read.tool_calls or read.reasoning else "")
    message = ParsedMessage(content, read.reasoning or None, read.tool_calls, finish_reason)
    if read.tool_calls:
        message.finish_reason = with_tool_calls(finish_reason)
    return message


def with_tool_calls(reason: str | None) -> str | None:
    """A turn that called tools ends with "tool_calls" (a cut-off one stays "length")."""
    return "tool_calls" if reason == "stop" else reason
