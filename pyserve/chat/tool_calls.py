"""Tool calls in generated text, as OpenAI reports them: parsed whole, or streamed.

Formats (``PARSERS``):

* ``hermes`` (Hermes, Qwen2.5, Qwen3): any number of
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, text around them.
* ``llama3_json`` (Llama 3.1 to 3.3): the output is ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` accepted too), optionally after ``<|python_tag|>``, calls separated by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.

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
import math
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pyserve.chat.markers import partial_marker_length


@dataclass
class ToolCall:
    """One call, as in an OpenAI ``tool_calls`` entry."""

    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ParsedOutput:
    """A whole output split into content (None when there is none) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One increment of one streamed call.

    The first delta of a call carries its ``index``, ``id`` and ``name`` (and empty
    arguments); the following ones carry only ``index`` and a fragment of ``arguments``.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


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


_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh call id like OpenAI's: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# ---------------------------------------------------------------------------------------------
# Incremental reading of one call object


_JSON_SPACE = " \t\n\r"
_STRING_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_VALUE_STARTS = frozenset('{["-0123456789tfn')
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_SHORT_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}
_WRITTEN_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}

# What the reader expects next, between tokens.
_VALUE, _KEY, _COLON, _COMMA = range(4)


def _written_char(ch: str) -> str:
    """One decoded string character as json.dumps(ensure_ascii=False) writes it.

    Lone surrogates are escaped (json.dumps would write them raw, which no UTF-8 encoder takes).
    """
    escaped = _WRITTEN_ESCAPES.get(ch)
    if escaped is not None:
        return escaped
    code = ord(ch)
    if code < 0x20 or 0xD800 <= code <= 0xDFFF:
        return f"\\u{code:04x}"
    return ch


class _CallReader:
    """Reads one call object incrementally, checking that it is JSON.

    It keeps the re-serialised text of the object's ``"name"`` value and of its first
    arguments value. Text is added only once final: a number or literal when it ends, a
    separator or key when the value after it begins. So the arguments gathered so far are
    always a prefix of the final arguments, and ``closing()`` can always complete them.
    Raw control characters inside strings are accepted (as json.loads(strict=False) does),
    since models write literal newlines in code arguments.
    """

    def __init__(self, arguments_keys: tuple[str, ...]) -> None:
        self.name_parts: list[str] | None = None
        self.name_done = False
        self.args_key: str | None = None
        self.args_first = ""  # first character of the arguments value
        self.args_parts: list[str] = []
        self.args_done = False
        self.done = False
        self.failed = False
        self._arguments_keys = arguments_keys
        self._stack: list[str] = []  # open containers, "{" or "["
        self._first: list[bool] = []  # per open container: nothing written in it yet
        self._expect = _VALUE
        self._can_close = False  # a container was just opened, so "}" or "]" may follow
        self._capturing: str | None = None  # "name" or "args" while reading that member
        self._sink: list[str] | None = None  # where written text goes; None drops it
        self._key_parts: list[str] = []  # written text of the current key
        self._token = ""  # "", "string", "number" or "literal"
        self._token_text = ""  # the number or literal so far
        self._lead = ""  # separator and key to write with that number or literal
        self._in_key = False
        self._escape: str | None = None  # text after a backslash, while reading an escape
        self._high: int | None = None  # a high surrogate waiting for its low half

    def feed(self, text: str) -> int:
        """Read ``text``; return how much was used (all, or up to the object's end or a fault)."""
        pos, end = 0, len(text)
        while pos < end and not (self.done or self.failed):
            if self._token == "string":
                pos = self._read_string(text, pos)
                continue
            ch = text[pos]
            if self._token == "number":
                if ch in _NUMBER_CHARS:
                    self._token_text += ch
                    pos += 1
                    continue
                self._end_number()  # ch is read below as what follows the number
            elif self._token == "literal":
                self._read_literal(ch)
                pos += 0 if self.failed else 1
                continue
            if self.failed:
                break
            if ch not in _JSON_SPACE:
                self._read_structure(ch)
                if self.failed:
                    break
            pos += 1
        return pos

    def closing(self) -> str:
        """What completes the arguments read so far into a valid object ("" if not needed)."""
        if self.args_first != "{" or self.args_done:
            return ""
        parts = []
        if self._token == "string" and not self._in_key and self._capturing == "args":
            if self._high is not None:
                parts.append(f"\\u{self._high:04x}")
            parts.append('"')
        parts.extend("}" if c == "{" else "]" for c in reversed(self._stack[1:]))
        return "".join(parts)

    def _fail(self) -> None:
        self.failed = True

    def _read_structure(self, ch: str) -> None:
        expect = self._expect
        if expect == _VALUE:
            if ch == "]" and self._can_close:
                self._close()
            else:
                self._start_value(ch)
        elif expect == _KEY:
            if ch == '"':
                self._key_parts = ['"']
                self._token, self._in_key = "string", True
            elif ch == "}" and self._can_close:
                self._close()
            else:
                self._fail()
        elif expect == _COLON:
            if ch == ":":
                self._expect, self._can_close = _VALUE, False
            else:
                self._fail()
        else:
            top = self._stack[-1]
            if ch == ",":
                self._expect = _KEY if top == "{" else _VALUE
                self._can_close = False
            elif ch == ("}" if top == "{" else "]"):
                self._close()
            else:
                self._fail()

    def _start_value(self, ch: str) -> None:
        if ch not in _VALUE_STARTS or (not self._stack and ch != "{"):
            self._fail()  # checked first, so that nothing is written for a bad value
            return
        depth = len(self._stack)
        lead = ""  # the separator and key written before this value
        if depth == 1:
            self._begin_member(ch)
        elif depth > 1 and self._sink is not None:
            if not self._first[-1]:
                lead = ", "
            if self._stack[-1] == "{":
                lead += "".join(self._key_parts) + ": "
        if self._stack:
            self._first[-1] = False
        if ch in '{["':
            if self._sink is not None:
                self._sink.append(lead + ch)
            if ch == '"':
                self._token, self._in_key = "string", False
            else:
                self._stack.append(ch)
                self._first.append(True)
                self._expect = _KEY if ch == "{" else _VALUE
                self._can_close = True
        else:
            # Written when it ends: a cut-off number must not leave a dangling key behind.
            self._token = "literal" if ch in _LITERALS else "number"
            self._token_text, self._lead = ch, lead

    def _begin_member(self, ch: str) -> None:
        """A value of the call object begins: keep it if it is the name or the arguments."""
        key = json.loads("".join(self._key_parts))
        self._capturing = self._sink = None
        if key == "name" and self.name_parts is None:
            self.name_parts = []
            self._capturing, self._sink = "name", self.name_parts
        elif key in self._arguments_keys and self.args_key is None:
            self.args_key, self.args_first = key, ch
            self._capturing, self._sink = "args", self.args_parts

    def _close(self) -> None:
        closer = "}" if self._stack.pop() == "{" else "]"
        self._first.pop()
        if self._sink is not None:
            self._sink.append(closer)
        self._end_value()

    def _end_value(self) -> None:
        if not self._stack:
            self.done = True
            return
        if len(self._stack) == 1:
            if self._capturing == "name":
                self.name_done = True
            elif self._capturing == "args":
                self.args_done = True
            self._capturing = self._sink = None
        self._expect, self._can_close = _COMMA, False

    def _read_string(self, text: str, pos: int) -> int:
        out = self._key_parts if self._in_key else self._sink
        if self._escape is not None:
            return self._read_escape(text[pos], pos, out)
        special = _STRING_SPECIAL.search(text, pos)
        stop = special.start() if special else len(text)
        if stop > pos:
            self._flush_high(out)
            if out is not None:
                out.append(text[pos:stop])
        if special is None:
            return stop
        ch = text[stop]
        if ch == "\\":
            self._escape = ""
            return stop + 1
        self._flush_high(out)
        if ch == '"':
            if out is not None:
                out.append('"')
            self._token = ""
            if self._in_key:
                self._expect = _COLON
            else:
                self._end_value()
        elif out is not None:
            out.append(_written_char(ch))  # a raw control character
        return stop + 1

    def _read_escape(self, ch: str, pos: int, out: list[str] | None) -> int:
        if self._escape == "":
            if ch == "u":
                self._escape = "u"
                return pos + 1
            decoded = _SHORT_ESCAPES.get(ch)
            if decoded is None:
                self._fail()
                return pos
            self._escape = None
            self._flush_high(out)
            if out is not None:
                out.append(_written_char(decoded))
            return pos + 1
        if ch not in string.hexdigits:
            self._fail()
            return pos
        self._escape = (self._escape or "") + ch
        if len(self._escape) == 5:
            self._code_point(int(self._escape[1:], 16), out)
            self._escape = None
        return pos + 1

    def _code_point(self, code: int, out: list[str] | None) -> None:
        if self._high is not None and 0xDC00 <= code <= 0xDFFF:
            pair = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
            if out is not None:
                out.append(chr(pair))
            return
        self._flush_high(out)
        if 0xD800 <= code <= 0xDBFF:
            self._high = code
        elif out is not None:
            out.append(_written_char(chr(code)))

    def _flush_high(self, out: list[str] | None) -> None:
        if self._high is not None:
            if out is not None:
                out.append(f"\\u{self._high:04x}")
            self._high = None

    def _end_number(self) -> None:
        text, self._token = self._token_text, ""
        if not _NUMBER.fullmatch(text):
            self._fail()
            return
        try:
            if any(c in text for c in ".eE"):
                value = float(text)
                if not math.isfinite(value):
                    raise ValueError(text)  # json.dumps would write Infinity, which is not JSON
                written = repr(value)  # what json.dumps writes for a float
            else:
                written = str(int(text))
        except ValueError:
            self._fail()
            return
        if self._sink is not None:
            self._sink.append(self._lead + written)
        self._end_value()

    def _read_literal(self, ch: str) -> None:
        word = _LITERALS[self._token_text[0]]
        if word[len(self._token_text)] != ch:
            self._fail()
            return
        self._token_text += ch
        if len(self._token_text) == len(word):
            self._token = ""
            if self._sink is not None:
                self._sink.append(self._lead + word)
            self._end_value()


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _object_text(text: str) -> str | None:
    """``text`` re-serialised if it is the JSON of an object, else None."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        pass
    return None


def _call_name(reader: _CallReader) -> str | None:
    if not reader.name_done or reader.name_parts is None:
        return None
    name = json.loads("".join(reader.name_parts))
    return name if isinstance(name, str) and name else None


def _call_of(reader: _CallReader, require_arguments: bool) -> tuple[str, str] | None:
    """(name, arguments) of a fully read object, or None if it is not a call."""
    name = _call_name(reader)
    if name is None:
        return None
    if reader.args_key is None:
        return None if require_arguments else (name, "{}")
    written = "".join(reader.args_parts)
    if reader.args_first == "{":
        return name, written
    if written == "null":
        return name, "{}"
    if reader.args_first == '"':
        unwrapped = _object_text(json.loads(written))
        return None if unwrapped is None else (name, unwrapped)
    return None


# ---------------------------------------------------------------------------------------------
# Streams


def _space_length(text: str) -> int:
    return len(text) - len(text.lstrip())


class ToolCallStream:
    """Splits one output into content and tool calls as it is generated.

    ``feed`` each new piece of text; it returns the content that can be shown now and the
    call deltas. Text that might still turn out to be part of a call (a trailing ``<tool``,
    an open call, whitespace that is dropped if a call follows) is held back; ``finish``
    releases or settles it at the end of the output.

    How arguments are streamed: a call is announced (index, id, name) once its name has been
    read and its arguments object has begun; from then on every ``feed`` sends, as one
    fragment, the re-serialised text of the arguments read so far. Fragments are always final
    (a number is sent when it ends, a separator with the value after it), so their
    concatenation is byte for byte the ``arguments`` that ``parse()`` reports. A call whose
    arguments precede its name, are a JSON string, or are missing is announced when its
    object closes, with all its arguments in one fragment.

    The one case where the stream cannot match ``parse()``: a call already announced that then
    turns out not to be one (invalid JSON further on, or the output cut off by max_tokens).
    A delta cannot be taken back, so the stream closes that call's arguments (adding the quote
    and brackets that make what was read a valid object) and then sends the call's text as
    content, as ``parse()`` reports it. The content is therefore the same as ``parse()``'s in
    every case; the calls differ only by such a cut-short extra call.

    Subclasses describe a format with states: ``_at_<state>(final)`` consumes from the front
    of ``_buf`` and returns whether it made progress; ``final`` means no more text will come.
    """

    _opener: ClassVar[str | None] = None  # text that opens a tool section inside content
    _start_state: ClassVar[str] = "content"
    _section_state: ClassVar[str] = ""  # the state after the opener
    _after_call_state: ClassVar[str] = ""
    _opening_states: ClassVar[frozenset[str]] = frozenset()  # section begun, no call yet
    _arguments_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    _require_arguments: ClassVar[bool] = False

    def __init__(self) -> None:
        self.tool_calls: list[ToolCall] = []  # calls sent so far, arguments as sent so far
        self._state = self._start_state
        self._buf = ""  # text not read yet
        self._held = ""  # read text whose fate is open: dropped if a call parses
        self._rewind_at = 0  # if the section fails: _held[:_rewind_at] is content, the rest re-read
        self._fresh = True  # at the start of a piece of content: its leading whitespace is held
        self._after_call = False  # the last thing read was a call: held whitespace can go
        self._reader: _CallReader | None = None
        self._open: int | None = None  # index of a call announced and not yet closed
        self._sent_parts = 0  # how many of the open call's argument parts were sent
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Read the next piece of output; return (content to emit now, call deltas)."""
        self._buf += delta
        self._run(final=False)
        self._announce()
        return self._drain()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: settle what was held back; return as feed() does."""
        self._end()
        return self._drain()

    def parse_all(self, text: str) -> ParsedOutput:
        """Parse a whole output with a fresh stream (what ToolCallParser.parse does)."""
        self._buf = text
        self._end()
        return ParsedOutput("".join(self._content) or None, self.tool_calls)

    # -- running states

    def _run(self, final: bool) -> None:
        while getattr(self, "_at_" + self._state)(final):
            pass

    def _end(self) -> None:
        while True:
            self._run(final=True)
            if self._state == "call":
                self._call_failed()  # cut off
            elif self._state in self._opening_states:
                self._abandon()
            else:
                break
        if not self._after_call:
            self._emit(self._held)
        self._held = ""

    def _drain(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _hold(self, size: int) -> None:
        self._held += self._buf[:size]
        self._buf = self._buf[size:]

    def _skip_space(self) -> bool:
        """Hold the buffer's leading whitespace; return whether anything else is left."""
        self._hold(_space_length(self._buf))
        return bool(self._buf)

    def _abandon(self) -> None:
        """The section being read is not calls: give its text back to content."""
        held, self._held = self._held, ""
        self._emit(held[: self._rewind_at])
        self._buf = held[self._rewind_at :] + self._buf  # read again: a call may start inside
        self._rewind_at = 0
        self._state, self._fresh, self._after_call = "content", False, False

    # -- content

    def _at_content(self, final: bool) -> bool:
        buf, opener = self._buf, self._opener
        if not buf:
            return False
        if self._fresh:
            if not self._skip_space():
                return False
            buf = self._buf
            if opener is not None and buf.startswith(opener):
                self._open_section()
                return True
            if opener is not None and opener.startswith(buf) and not final:
                return False
            self._emit(self._held)  # the content has text, so its whitespace stays
            self._held, self._fresh, self._after_call = "", False, False
            return True
        if opener is None:
            self._emit(buf)
            self._buf = ""
            return False
        at = buf.find(opener)
        if at >= 0:
            self._emit(buf[:at])
            self._buf = buf[at:]
            self._open_section()
            return True
        keep = 0 if final else partial_marker_length(buf, opener)
        self._emit(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _open_section(self) -> None:
        assert self._opener is not None
        self._hold(len(self._opener))
        self._rewind_at = len(self._held)
        self._state = self._section_state

    # -- calls

    def _expect_call(self) -> bool:
        """After optional whitespace a call object must begin, or the section is abandoned."""
        if not self._skip_space():
            return False
        if self._buf[0] == "{":
            self._start_call()
        else:
            self._abandon()
        return True

    def _start_call(self) -> None:
        self._reader = _CallReader(self._arguments_keys)
        self._state = "call"

    def _at_call(self, final: bool) -> bool:
        reader = self._reader
        assert reader is not None
        self._hold(reader.feed(self._buf))
        if reader.failed:
            self._call_failed()
            return True
        if not reader.done:
            return False
        call = _call_of(reader, self._require_arguments)
        if call is None:
            self._call_failed()
        else:
            self._close_call(*call)
        return True

    def _announce(self) -> None:
        """After a feed: announce the call being read if possible, send its new arguments."""
        reader = self._reader
        if self._state != "call" or reader is None:
            return
        if self._open is None:
            name = _call_name(reader)
            if name is None or reader.args_first != "{":
                return
            self._open = self._new_call(name)
        self._send_parts(reader)

    def _new_call(self, name: str) -> int:
        index = len(self.tool_calls)
        call = ToolCall(new_call_id(), name, "")
        self.tool_calls.append(call)
        self._deltas.append(ToolCallDelta(index, call.id, name))
        self._sent_parts = 0
        return index

    def _send(self, index: int, fragment: str) -> None:
        if fragment:
            self.tool_calls[index].arguments += fragment
            self._deltas.append(ToolCallDelta(index, arguments=fragment))

    def _send_parts(self, reader: _CallReader) -> None:
        assert self._open is not None
        parts = reader.args_parts
        if len(parts) > self._sent_parts:
            self._send(self._open, "".join(parts[self._sent_parts :]))
            self._sent_parts = len(parts)

    def _close_call(self, name: str, arguments: str) -> None:
        index = self._open if self._open is not None else self._new_call(name)
        sent = self.tool_calls[index].arguments
        self._send(index, arguments[len(sent) :])  # sent is a prefix of arguments
        self._open, self._reader = None, None
        self._held, self._rewind_at = "", 0
        self._fresh = self._after_call = True
        self._state = self._after_call_state

    def _call_failed(self) -> None:
        reader = self._reader
        if self._open is not None and reader is not None:
            self._send_parts(reader)
            self._send(self._open, reader.closing())
        self._open, self._reader = None, None
        self._abandon()


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


class _MistralStream(ToolCallStream):
    """``[TOOL_CALLS]`` and a JSON array of calls; the closing bracket may be missing."""

    _opener = "[TOOL_CALLS]"
    _section_state = "open"
    _after_call_state = "after"
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

    def _at_first(self, final: bool) -> bool:
        return self._expect_call()

    def _at_next(self, final: bool) -> bool:
        return self._expect_call()

    def _at_after(self, final: bool) -> bool:
        if not self._skip_space():
            return False
        if self._buf[0] == ",":
            self._hold(1)
            self._state = "next"
        elif self._buf[0] == "]":
            self._buf, self._held = self._buf[1:], ""
            self._state, self._fresh = "content", True
        else:
            self._abandon()
        return True


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


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

# Checked in this order: what each format's chat template writes around tool calls.
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
    ("llama3_json", ("<|python_tag|>", "ipython")),
)


def parser_for_template(chat_template: str | None) -> str | None:
    """The tool-call format a chat template uses (a PARSERS key), or None if it has none."""
    if not chat_template:
        return None
    for name, markers in _TEMPLATE_MARKERS:
        if any(marker in chat_template for marker in markers):
            return name
    return None
