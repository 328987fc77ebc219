"""One chat choice's generated text as OpenAI's assistant message: thought, content, tool calls.

A reasoning parser splits ``<think>...</think>`` off into ``reasoning_content``; a tool-call
parser turns the format's call blocks into ``tool_calls`` (and the finish reason into
"tool_calls"), and the generic format's reply object into its text. Streamed, each generated
chunk becomes one delta carrying whichever of the three it advanced; a stream holds back text
that may still turn out to be a marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.chat.reasoning import ReasoningParser, ReasoningStream
from pyserve.chat.tool_calls import ToolCallParser
from pyserve.chat.tool_stream import ToolCallDelta, ToolCallStream


@dataclass(frozen=True)
class ChatOutput:
    """How one request's choices are read; None parts are off."""

    tools: ToolCallParser | None = None
    reasoning: ReasoningParser | None = None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a whole output, and its finish reason."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text)
        message: dict = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tools is not None and content:
            parsed = self.tools.parse(content)
            # The content may change without calls: the generic format's reply is the string
            # inside its object. Beside calls, no content is null, as OpenAI writes it.
            message["content"] = parsed.content or (None if parsed.tool_calls else "")
            if parsed.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in parsed.tool_calls
                ]
                finish_reason = _with_tool_calls(finish_reason)
        return message, finish_reason

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    def __init__(self, output: ChatOutput) -> None:
        self._reasoning: ReasoningStream | None = (
            output.reasoning.stream() if output.reasoning is not None else None
        )
        self._tools: ToolCallStream | None = (
            output.tools.stream() if output.tools is not None else None
        )
        self.called = False  # a tool call has been sent

    def feed(self, text: str) -> dict | None:
        """The delta for the next piece of generated text, or None if it holds nothing yet."""
        return self._delta(text, final=False)

    def finish(self) -> dict | None:
        """The delta of what was held back, at the end of the output."""
        return self._delta("", final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        return _with_tool_calls(reason) if self.called else reason

    def _delta(self, text: str, final: bool) -> dict | None:
        thought, content = "", text
        if self._reasoning is not None:
            thought, content = self._reasoning.finish() if final else self._reasoning.feed(text)
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content) if content else ("", [])
            if final:
                more, late = self._tools.finish()
                content, calls = content + more, calls + late
        delta: dict = {}
        if thought:
            delta["reasoning_content"] = thought
        if content:
            delta["content"] = content
        if calls:
            self.called = True
            delta["tool_calls"] = [_call_delta(call) for call in calls]
        return delta or None


def _call_delta(call: ToolCallDelta) -> dict:
    """OpenAI's streamed tool call: index, id, type and name first, then argument fragments."""
    if call.id is not None:
        return {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    return {"index": call.index, "function": {"arguments": call.arguments}}


def _with_tool_calls(reason: str | None) -> str | None:
    """OpenAI ends a turn that called tools with "tool_calls" (a cut-off one stays "length")."""
    return "tool_calls" if reason == "stop" else reason
