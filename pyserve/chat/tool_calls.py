"""Tool calls in generated text, as OpenAI reports them: parsed whole, or streamed.

Formats (``PARSERS``):

* ``hermes`` (Hermes, Qwen2.5, Qwen3): any number of
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, text around them.
* ``llama3_json`` (Llama 3.1 to 3.3): the output is ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` accepted too), optionally after ``<|python_tag|>``, calls separated by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.
* ``generic`` (any model, for templates with no format of their own): the output is one JSON
  object, ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` or ``{"response": "..."}``,
  whose decoded string is the content (``generic_tools``).

Rules shared by all formats:

* ``ToolCall.arguments`` is always the JSON text of an object, written the way
  ``json.dumps(value, ensure_ascii=False)`` writes it (``", "`` and ``": "``, key order kept).
  A missing or null arguments value becomes ``"{}"`` (not for llama3_json, whose calls are bare
  JSON and need the key to be told from a JSON answer); arguments given as a JSON string that
  holds an object are unwrapped.
* Nothing is lost. A call that is not valid JSON, has no name, or is cut off stays in the
  content exactly as generated. Only what belongs to calls that parsed is removed: their
  markers and separators, and text between them (or between one and either end of the output)
  that is only whitespace. An output with no call that parses is returned unchanged.
* Streaming gives what parse() gives, for any split of the output into deltas; the one
  exception is described in ``ToolCallStream``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pyserve.chat.generic_tools import GenericStream
from pyserve.chat.tool_stream import CallArrayStream, ParsedOutput, ToolCallStream


@dataclass(frozen=True)
class CallFormat:
    """How a format writes a list of calls, so that a grammar can force one.

    The text is ``begin``, then each call as ``call_prefix`` + a JSON object + ``call_suffix``,
    with ``separator`` between calls, then ``end``. The object is
    ``{"<name_key>": <tool name>, "<arguments_key>": <arguments object>}``. ``render`` writes
    exactly this; the parsers accept it and looser spacing.
    """

    begin: str  # opens the tool section, once
    call_prefix: str  # before each call's object
    call_suffix: str  # after each call's object
    separator: str  # between two calls
    end: str  # closes the tool section
    arguments_key: str  # "arguments" or "parameters"
    name_key: str = "name"

    def render(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
        """The text a model writes for these (name, arguments) calls."""
        written = [
            self.call_prefix
            + json.dumps({self.name_key: name, self.arguments_key: args}, ensure_ascii=False)
            + self.call_suffix
            for name, args in calls
        ]
        return self.begin + self.separator.join(written) + self.end


class _HermesStream(ToolCallStream):
    """``<tool_call> {...} </tool_call>`` blocks; the closing tag may be missing."""

    _opener = "<tool_call>"
    _closer = "</tool_call>"
    _section_state = "open"
    _after_call_state = "after"
    _opening_states = frozenset({"open"})

    def _at_open(self, final: bool) -> bool:
        return self._expect_call()

    def _at_after(self, final: bool) -> bool:
        if not self._skip_space():
            return False
        if self._buf.startswith(self._closer):
            self._buf = self._buf[len(self._closer) :]
            self._held = ""  # the call's own markup
        elif self._closer.startswith(self._buf) and not final:
            return False
        self._state = "content"  # a fresh piece of content, whose leading space is held
        return True


class _MistralStream(CallArrayStream):
    """``[TOOL_CALLS]`` and a JSON array of calls; the closing bracket may be missing."""

    _opener = "[TOOL_CALLS]"
    _section_state = "open"
    _opening_states = frozenset({"open", "first"})

    def _expect(self, ch: str, state: str) -> bool:
        if not self._skip_space():
            return False
        if self._buf[0] == ch:
            self._hold(1)
            self._state = state
        else:
            self._abandon()
        return True

    def _at_open(self, final: bool) -> bool:
        return self._expect("[", "first")

    def _array_closed(self) -> None:
        self._state, self._fresh = "content", True


class _Llama3JsonStream(ToolCallStream):
    """The whole output is calls: ``[<|python_tag|>] {...} [; {...}]...``."""

    _tag = "<|python_tag|>"
    _start_state = "start"
    _after_call_state = "after"
    _opening_states = frozenset({"start", "tagged"})
    _require_arguments = True  # a bare JSON answer with a "name" field is not a call

    def _at_start(self, final: bool) -> bool:
        if not self._skip_space():
            return False
        if self._buf.startswith(self._tag):
            self._hold(len(self._tag))
            self._state = "tagged"
            return True
        if self._tag.startswith(self._buf) and not final:
            return False
        return self._expect_call()

    def _at_tagged(self, final: bool) -> bool:
        return self._expect_call()

    def _at_sep(self, final: bool) -> bool:
        return self._expect_call()

    def _at_after(self, final: bool) -> bool:
        if not self._skip_space():
            return False
        if self._buf[0] == ";":
            self._hold(1)
            self._state = "sep"
            return True
        return self._expect_call()  # calls separated by whitespace only are accepted too


# ---------------------------------------------------------------------------------------------
# Parsers


class ToolCallParser:
    """One tool-call format: parse whole outputs, or open a stream for one output.

    Parsers hold no state; one instance can serve every request.
    """

    name: ClassVar[str]
    call_format: ClassVar[CallFormat]
    stream_class: ClassVar[type[ToolCallStream]]

    def parse(self, text: str) -> ParsedOutput:
        """Split a finished output into content and tool calls."""
        return self.stream_class().parse_all(text)

    def stream(self) -> ToolCallStream:
        """A new stream for one output."""
        return self.stream_class()


class HermesToolParser(ToolCallParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{...}\\n</tool_call>`` blocks."""

    name = "hermes"
    call_format = CallFormat(
        begin="",
        call_prefix="<tool_call>\n",
        call_suffix="\n</tool_call>",
        separator="\n",
        end="",
        arguments_key="arguments",
    )
    stream_class = _HermesStream


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.1-3.3 JSON tool calling: the output is ``{"name": ..., "parameters": ...}``."""

    name = "llama3_json"
    # The templates ask for bare JSON; <|python_tag|> is for built-in tools, so not written.
    call_format = CallFormat(
        begin="",
        call_prefix="",
        call_suffix="",
        separator="; ",
        end="",
        arguments_key="parameters",
    )
    stream_class = _Llama3JsonStream


class MistralToolParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

    name = "mistral"
    call_format = CallFormat(
        begin="[TOOL_CALLS][",
        call_prefix="",
        call_suffix="",
        separator=", ",
        end="]",
        arguments_key="arguments",
    )
    stream_class = _MistralStream


class GenericToolParser(ToolCallParser):
    """Any model: one JSON object of calls, ``{"tool_calls": [...]}``, or a reply,
    ``{"response": "..."}``; the tools are described in the system message (``generic_tools``).

    ``replies=False`` when an answer that is not calls is a response format's JSON: such an
    answer is then the content as written, even with a ``response`` key.
    """

    name = "generic"
    call_format = CallFormat(
        begin='{"tool_calls": [',
        call_prefix="",
        call_suffix="",
        separator=", ",
        end="]}",
        arguments_key="arguments",
    )
    stream_class = GenericStream

    def __init__(self, replies: bool = True) -> None:
        self.replies = replies

    def parse(self, text: str) -> ParsedOutput:
        return self.stream().parse_all(text)

    def stream(self) -> ToolCallStream:
        return GenericStream(replies=self.replies)


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, GenericToolParser)
}

# Checked in this order: what each format's chat template writes around tool calls.
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
    ("llama3_json", ("<|python_tag|>", "ipython")),
)


def parser_for_template(chat_template: str | None) -> str | None:
    """The tool-call format a chat template writes (a PARSERS key), or None if it has none (a
    server then uses ``generic``)."""
    if not chat_template:
        return None
    for name, markers in _TEMPLATE_MARKERS:
        if any(marker in chat_template for marker in markers):
            return name
    return None
