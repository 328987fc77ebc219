"""gpt-oss's "harmony" turns read back as an assistant message: thought, content, tool calls.

A harmony model answers in messages, each a header and a body. The prompt ends with
``<|start|>assistant``, so the output starts inside the first header:
``<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>
the answer``. A tool call is a message addressed to the function, ``<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}`` (the recipient may also come before the
channel). ``<|return|>`` and ``<|call|>`` end the turn (stop tokens, whose text the output
leaves out); ``<|end|>`` ends one message. Every marker is a special token, so a harmony
output is detokenized with special tokens kept and read here as text.

Where each message goes:

* ``analysis`` → reasoning; ``final``, and ``commentary`` without a recipient (a preamble) →
  content; a message to ``functions.NAME`` on any channel → a tool call whose arguments are
  the body as written (the header, not the body, makes it a call, as vLLM and SGLang read it;
  an empty body is ``{}``); a message to another recipient (a built-in tool) → reasoning.
  Without ``calls`` (the request offers no tools) a function's message is content.
* Two messages of one kind are joined with a blank line.
* Nothing raises. A body the output cuts off ends with it (a call keeps the arguments it has);
  a stray marker inside a body is dropped; a header that is never finished is dropped, unless
  it holds no markup at all (a model that ignored the format), which is then content.
* Streaming gives what ``HarmonyFormat.parse`` gives, for any split of the output (call ids
  aside): both run the same reader.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from pyserve.chat.tool_stream import ToolCall, ToolCallDelta, new_call_id

HARMONY = "harmony"  # its name for --tool-call-parser and --reasoning-parser

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
# The special tokens a harmony tokenizer has (o200k_harmony), and those that end a turn.
MARKERS = (START, END, MESSAGE, CHANNEL, RETURN, CALL)
TURN_ENDS = (RETURN, CALL)

_SPECIAL = re.compile(
    r"<\|(?:start|end|message|channel|constrain|return|call|endoftext|startoftext|reserved_\d+)\|>"
)
_PARTIAL = re.compile(r"<(?:\|[a-z_0-9]{0,24}\|?)?\Z")  # an end of text that may grow into one
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_FUNCTIONS = "functions."
_LONGEST_HEADER = 256  # longer, with no markup and no body: not a header but plain text
_JOIN = "\n\n"


def is_harmony(special_tokens: Mapping[str, int], chat_template: str | None) -> bool:
    """Whether a model writes harmony: its vocabulary has the format's markers as special
    tokens and its chat template writes channels (a model fine-tuned to another format on the
    same vocabulary does not)."""
    return all(m in special_tokens for m in MARKERS) and CHANNEL in (chat_template or "")


def turn_end_ids(special_tokens: Mapping[str, int]) -> list[int]:
    """The ids of ``<|return|>`` and ``<|call|>``, which must stop generation whatever the
    model's files list as EOS (a GGUF file may name only ``<|return|>``)."""
    return [special_tokens[m] for m in TURN_ENDS if m in special_tokens]


@dataclass
class HarmonyMessage:
    """A whole output as an assistant turn's parts; "" where a part has no text."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]


@dataclass
class HarmonyDelta:
    """What one piece of output advanced."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class HarmonyFormat:
    """How one request's harmony outputs are read; holds no state."""

    calls: bool = True  # messages to functions are tool calls (the request offers tools)

    def parse(self, text: str) -> HarmonyMessage:
        stream = self.stream()
        delta = stream.feed(text)
        rest = stream.finish()
        return HarmonyMessage(
            delta.reasoning + rest.reasoning, delta.content + rest.content, stream.tool_calls
        )

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self.calls)


class HarmonyStream:
    """Reads one output as it is generated. Text that may be the start of a marker (a
    trailing ``<|en``) and an unfinished header are held back until settled."""

    def __init__(self, calls: bool) -> None:
        self._calls = calls
        self.tool_calls: list[ToolCall] = []  # as sent so far
        self._state = "header"  # header | body | between
        self._buf = ""  # text not read yet
        self._header = ""  # the header read so far
        self._kind = ""  # the open message's: reasoning | content | call
        self._spoke = False  # the open message has sent text
        self._written = {"reasoning": False, "content": False}  # by earlier messages
        self._began = False  # a message has begun: an unfinished header is then markup
        self._out = HarmonyDelta()

    def feed(self, text: str) -> HarmonyDelta:
        """Read the next piece of output; return what it advanced."""
        self._buf += text
        self._run(final=False)
        return self._drain()

    def finish(self) -> HarmonyDelta:
        """At the end of the output: return what was held back."""
        self._run(final=True)
        if self._state == "body":
            self._close()
        elif self._state == "header" and not self._began and not _is_markup(self._header):
            self._open("content")  # a model that wrote no harmony: its text is the answer
            self._send(self._header)
            self._close()
        self._state, self._header = "between", ""
        return self._drain()

    def _drain(self) -> HarmonyDelta:
        out, self._out = self._out, HarmonyDelta()
        return out

    def _run(self, final: bool) -> None:
        while self._buf and getattr(self, "_at_" + self._state)(final):
            pass

    def _keep(self, text: str, final: bool) -> int:
        """How much of the end of ``text`` to hold back: what may still become a marker."""
        partial = None if final else _PARTIAL.search(text)
        return len(text) - partial.start() if partial else 0

    # -- states: each reads from the front of _buf and says whether to go on

    def _at_between(self, final: bool) -> bool:
        buf = self._buf.lstrip()
        if START.startswith(buf) and not final:
            return False  # only a start marker's beginning so far
        self._buf = buf.removeprefix(START)
        self._state, self._header = "header", ""  # no <|start|>: the header follows anyway
        return True

    def _at_header(self, final: bool) -> bool:
        buf = self._buf
        for marker in _SPECIAL.finditer(buf):
            token = marker.group()
            if token == MESSAGE:
                self._header += buf[: marker.start()]
                self._buf = buf[marker.end() :]
                self._begin_body()
                return True
            if token in (START, END, RETURN, CALL):  # a header without a body: dropped
                self._began = True
                self._buf = buf[marker.end() :]
                self._state = "header" if token == START else "between"
                self._header = ""
                return True
        keep = self._keep(buf, final)
        self._header += buf[: len(buf) - keep]
        self._buf = buf[len(buf) - keep :]
        header = self._header
        if not _is_markup(header) and ("\n" in header or len(header) > _LONGEST_HEADER):
            self._open("content")  # plain text where a header should be
            self._header = ""
            self._state = "body"
            self._send(header)
            return True
        return False

    def _at_body(self, final: bool) -> bool:
        buf = self._buf
        marker = _SPECIAL.search(buf)
        if marker is None:
            keep = self._keep(buf, final)
            self._send(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._send(buf[: marker.start()])
        self._buf = buf[marker.end() :]
        token = marker.group()
        if token in (END, RETURN, CALL):
            self._close()
            self._state = "between"
        elif token in (START, CHANNEL):  # a new message without the old one's end
            self._close()
            self._state = "header"
            self._header = token if token == CHANNEL else ""
        return True  # any other marker inside a body is dropped

    # -- messages

    def _begin_body(self) -> None:
        header, self._header = self._header, ""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        to = recipient.group(1) if recipient else None
        self._state = "body"
        if to is not None and to.startswith(_FUNCTIONS) and self._calls:
            self._open("call")
            name = to[len(_FUNCTIONS) :]
            call = ToolCall(new_call_id(), name, "")
            self._out.tool_calls.append(ToolCallDelta(len(self.tool_calls), call.id, name))
            self.tool_calls.append(call)
        elif to is not None and not to.startswith(_FUNCTIONS) and to != "assistant":
            self._open("reasoning")  # a built-in tool's call: the model's own work
        elif channel is not None and channel.group(1) == "analysis" and to is None:
            self._open("reasoning")
        else:
            self._open("content")

    def _open(self, kind: str) -> None:
        self._kind, self._spoke, self._began = kind, False, True

    def _send(self, text: str) -> None:
        if not text:
            return
        kind = self._kind
        if kind == "call":
            index = len(self.tool_calls) - 1
            self.tool_calls[index].arguments += text
            self._out.tool_calls.append(ToolCallDelta(index, arguments=text))
            return
        if not self._spoke and self._written[kind]:
            text = _JOIN + text
        self._spoke = self._written[kind] = True
        if kind == "reasoning":
            self._out.reasoning += text
        else:
            self._out.content += text

    def _close(self) -> None:
        if self._kind == "call" and not self.tool_calls[-1].arguments:
            self._send("{}")  # a function that takes no arguments
        self._kind = ""


def _is_markup(header: str) -> bool:
    if _SPECIAL.search(header) or _RECIPIENT.search(header):
        return True
    return header.lstrip().startswith("assistant")  # a role: a header cut off
