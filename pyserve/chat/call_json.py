"""Incremental reading of one tool call's JSON object: the lexer under every tool-call format.

``CallReader`` checks that text is JSON while it arrives, and keeps the re-serialised text of the
object's name and arguments, so that a stream can send arguments before the object closes.
"""

from __future__ import annotations

import json
import math
import re
import string
from typing import Any

_JSON_SPACE = " \t\n\r"
_STRING_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_VALUE_STARTS = frozenset('{["-0123456789tfn')
_LITERALS = {"t": "true", "f": "false", "n": "null"}
SHORT_ESCAPES = {  # JSON's two-character escapes, decoded
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


class CallReader:
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
            decoded = SHORT_ESCAPES.get(ch)
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


def object_text(text: str) -> str | None:
    """``text`` re-serialised if it is the JSON of an object, else None."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        pass
    return None


def call_name(reader: CallReader) -> str | None:
    if not reader.name_done or reader.name_parts is None:
        return None
    name = json.loads("".join(reader.name_parts))
    return name if isinstance(name, str) and name else None


def call_of(reader: CallReader, require_arguments: bool) -> tuple[str, str] | None:
    """(name, arguments) of a fully read object, or None if it is not a call."""
    name = call_name(reader)
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
        unwrapped = object_text(json.loads(written))
        return None if unwrapped is None else (name, unwrapped)
    return None
