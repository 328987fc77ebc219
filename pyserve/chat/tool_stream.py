"""Splitting one output into content and tool calls as it is generated: the machinery that
every format's stream shares (the formats themselves are in ``tool_calls``)."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import ClassVar

from pyserve.chat.call_json import CallReader, call_name, call_of
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


_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh call id like OpenAI's: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


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
        self._reader: CallReader | None = None
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
        self._reader = CallReader(self._arguments_keys)
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
        call = call_of(reader, self._require_arguments)
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
            name = call_name(reader)
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

    def _send_parts(self, reader: CallReader) -> None:
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


class CallArrayStream(ToolCallStream):
    """A format whose calls are a JSON array, ``[ call, call ]``: after its opening the states
    ``first``, ``next`` and ``after`` read the calls, and ``_array_closed`` says where the text
    goes once ``]`` is read."""

    _after_call_state = "after"

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
            self._array_closed()
        else:
            self._abandon()
        return True

    def _array_closed(self) -> None:
        raise NotImplementedError
