"""The generic tool-call format, for chat templates that have none of their own.

The model answers with one JSON object: ``{"tool_calls": [{"name": ..., "arguments": {...}},
...]}`` to call tools, or ``{"response": "..."}`` to reply (the format llama.cpp calls generic).
The template knows nothing of tools, so the tools and these instructions go into the system
message, earlier calls become their JSON object as the assistant's text, and tool results
become user turns; a grammar (``tool_grammar``) holds the model to the object.

Reading the output back (``GenericStream``): calls are read as every format reads them; the
reply's string is decoded as it arrives, so it streams as content; anything that is not the
object stays content as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyserve.chat.call_json import SHORT_ESCAPES
from pyserve.chat.tool_stream import CallArrayStream

REPLY_KEY = "response"
# The reply object, as a grammar forces it when the model may answer instead of calling.
REPLY_SCHEMA: dict = {
    "type": "object",
    "properties": {REPLY_KEY: {"type": "string"}},
    "required": [REPLY_KEY],
    "additionalProperties": False,
}

_SPACE = "[ \t\n\r]*"  # JSON's whitespace, not Python's
_CALLS_OPENING = rf'{_SPACE}\{{{_SPACE}"tool_calls"{_SPACE}:{_SPACE}\['
_REPLY_OPENING = rf'{_SPACE}\{{{_SPACE}"{REPLY_KEY}"{_SPACE}:{_SPACE}"'
_STRING_END_OR_ESCAPE = re.compile(r'["\\]')
_HEX = frozenset("0123456789abcdefABCDEF")
_REPLACEMENT = "\ufffd"  # for a lone surrogate, which no UTF-8 text can hold


def _prefixes(pieces: Sequence[str]) -> str:
    """A regex matching every prefix of the sequence ``pieces`` (literal text, or ``_SPACE``)."""
    if not pieces:
        return ""
    first, rest = pieces[0], _prefixes(pieces[1:])
    if first == _SPACE:
        return _SPACE + rest
    nested = rest
    for ch in reversed(first):
        nested = f"(?:{re.escape(ch)}{nested})?"
    return nested


def _opening_prefix(key: str, value_start: str) -> str:
    return _prefixes(["{", _SPACE, f'"{key}"', _SPACE, ":", _SPACE, value_start])


# By whether replies are read: what opens the object (group 1: calls, group 2: a reply), and
# what may still become such an opening.
_CALLS_PARTIAL = _opening_prefix("tool_calls", "[")
_REPLY_PARTIAL = _opening_prefix(REPLY_KEY, '"')
_OPENINGS = {
    True: re.compile(f"({_CALLS_OPENING})|({_REPLY_OPENING})"),
    False: re.compile(f"({_CALLS_OPENING})"),
}
_PARTIAL_OPENINGS = {
    True: re.compile(f"{_SPACE}(?:{_CALLS_PARTIAL}|{_REPLY_PARTIAL})"),
    False: re.compile(f"{_SPACE}{_CALLS_PARTIAL}"),
}


class GenericStream(CallArrayStream):
    """One output of the generic format, split into content and calls as it is generated.

    ``replies``: ``{"response": "..."}`` is a reply whose string is the content; off when the
    answer is a response format's JSON, which is then content as written (a schema could have
    a ``response`` key of its own).
    """

    _start_state = "start"
    _opening_states = frozenset({"first"})

    def __init__(self, replies: bool = True) -> None:
        super().__init__()
        self._opening = _OPENINGS[replies]
        self._partial = _PARTIAL_OPENINGS[replies]
        self._high: int | None = None  # a high surrogate escape waiting for its low half

    # -- the opening: which of the two objects, if either

    def _at_start(self, final: bool) -> bool:
        found = self._opening.match(self._buf)
        if found is not None:
            if found.group(1) is not None:
                self._hold(found.end())
                self._rewind_at = len(self._held)
                self._state = "first"
            else:  # committed: the reply's text streams from here on
                self._buf = self._buf[found.end() :]
                self._state = "reply"
            return True
        if not final and self._partial.fullmatch(self._buf):
            return False
        self._abandon()  # not the object: all of it is content
        return True

    # -- calls: {"tool_calls": [ call, call ] }

    def _array_closed(self) -> None:
        self._state = "close"

    def _at_close(self, final: bool) -> bool:
        """After the list: the object's closing brace, if there, belongs to the calls."""
        if not self._skip_space():
            return False
        if self._buf[0] == "}":
            self._buf, self._held = self._buf[1:], ""
        self._state, self._fresh = "content", True
        return True

    # -- the reply: {"response": "<decoded text streams as content>"}

    def _at_reply(self, final: bool) -> bool:
        buf, pos = self._buf, 0
        while pos < len(buf):
            ch = buf[pos]
            if ch == '"':
                self._flush_high()
                self._buf = buf[pos + 1 :]
                self._state, self._after_call = "reply_end", True
                return True
            if ch != "\\":
                special = _STRING_END_OR_ESCAPE.search(buf, pos)
                stop = special.start() if special else len(buf)
                self._flush_high()
                self._emit(buf[pos:stop])
                pos = stop
                continue
            used = self._escape(buf, pos, final)
            if used is None:  # not JSON: the rest is content as written
                self._flush_high()
                self._buf = buf[pos:]
                self._state, self._fresh = "content", False
                return True
            if used == 0:  # the escape is not complete yet
                break
            pos += used
        self._buf = buf[pos:]
        if final:
            self._flush_high()  # cut off: nothing can pair with it now
        return False

    def _escape(self, buf: str, pos: int, final: bool) -> int | None:
        """Decode the escape at ``pos``; its length, 0 if it needs more text, None if bad."""
        if pos + 1 >= len(buf):
            return None if final else 0
        kind = buf[pos + 1]
        if kind != "u":
            decoded = SHORT_ESCAPES.get(kind)
            if decoded is None:
                return None
            self._flush_high()
            self._emit(decoded)
            return 2
        digits = buf[pos + 2 : pos + 6]
        if any(d not in _HEX for d in digits):
            return None
        if len(digits) < 4:
            return None if final else 0
        code = int(digits, 16)
        if self._high is not None and 0xDC00 <= code <= 0xDFFF:
            self._emit(chr(0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)))
            self._high = None
        else:
            self._flush_high()
            if 0xD800 <= code <= 0xDBFF:
                self._high = code
            else:
                self._emit(_REPLACEMENT if 0xDC00 <= code <= 0xDFFF else chr(code))
        return 6

    def _flush_high(self) -> None:
        if self._high is not None:
            self._emit(_REPLACEMENT)
            self._high = None

    def _at_reply_end(self, final: bool) -> bool:
        """After the reply's string: the closing brace goes, anything else is content."""
        if not self._skip_space():
            return False
        if self._buf[0] == "}":
            self._buf, self._held = self._buf[1:], ""
            self._state, self._fresh = "content", True
        else:
            self._emit(self._held)
            self._held = ""
            self._state, self._fresh, self._after_call = "content", False, False
        return True


# ---------------------------------------------------------------------------------------------
# The prompt


@dataclass(frozen=True)
class GenericPrompt:
    """How a conversation is shown to a template that knows nothing of tools.

    ``system``: the tools and the format's instructions, put before the request's own system
    message (or as a new one); None when no tools are offered, in which case only earlier calls
    and results are rewritten.
    """

    system: str | None = None

    def messages(self, messages: list[dict]) -> list[dict]:
        """The template's messages (as ``ChatMessage.as_template_input`` writes them)."""
        out = _rewrite_history(messages)
        if self.system is None:
            return out
        if out and out[0].get("role") == "system":
            own = out[0].get("content") or ""
            first = {**out[0], "content": self.system + ("\n\n" + own if own else "")}
            return [first, *out[1:]]
        return [{"role": "system", "content": self.system}, *out]


def instructions(
    tools: Sequence[dict],
    *,
    named: str | None = None,
    required: bool = False,
    parallel: bool = True,
    json_answer: bool = False,
) -> str:
    """The system text that describes ``tools`` (OpenAI tool definitions) and the format.

    ``named``: the one tool to call; ``required``: a call is a must; ``json_answer``: an answer
    that is not calls is a response format's JSON rather than a reply object.
    """
    described = "\n".join(json.dumps(_tool_description(t), ensure_ascii=False) for t in tools)
    example_name = named or "<tool name>"
    more = ", ..." if parallel and not named else ""
    calls = f'{{"tool_calls": [{{"name": "{example_name}", "arguments": {{...}}}}{more}]}}'
    lines = [
        "You can call these tools (functions), described in JSON:",
        described,
        "",
        "Answer with one JSON object and nothing else.",
    ]
    if named is not None:
        lines.append(f'Call the tool "{named}", once:')
        lines.append(calls)
    elif required:
        lines.append("Call " + ("one or more tools:" if parallel else "exactly one tool:"))
        lines.append(calls)
    else:
        count = "one or more tools" if parallel else "one tool"
        lines.append(f"To call {count}:")
        lines.append(calls)
        if json_answer:
            lines.append("Or, to answer without a call, the JSON object of your answer.")
        else:
            lines.append("Or, to reply to the user without a call:")
            lines.append('{"' + REPLY_KEY + '": "<your reply>"}')
    lines.append("Tool results come back in user messages holding a tool_response object.")
    return "\n".join(lines)


def _tool_description(tool: dict) -> dict:
    function = tool.get("function", tool)
    described = {"name": function.get("name")}
    if function.get("description"):
        described["description"] = function["description"]
    described["parameters"] = function.get("parameters") or {"type": "object"}
    return described


def _rewrite_history(messages: list[dict]) -> list[dict]:
    """Earlier calls as the JSON object the model would write; tool results as user turns (a
    run of results is one turn, so that templates insisting on alternating roles take it)."""
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> tool name, to label results
    results: list[str] = []

    def flush_results() -> None:
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results.clear()

    for message in messages:
        role = message.get("role")
        if role == "tool":
            results.append(_result_text(message, names))
            continue
        flush_results()
        calls = message.get("tool_calls") if role == "assistant" else None
        if not calls:
            out.append(message)
            continue
        written = []
        for call in calls:
            function = call.get("function", {})
            if call.get("id"):
                names[call["id"]] = function.get("name", "")
            written.append({"name": function.get("name"), "arguments": function.get("arguments")})
        text = json.dumps({"tool_calls": written}, ensure_ascii=False)
        content = message.get("content") or ""
        rewritten = {k: v for k, v in message.items() if k != "tool_calls"}
        rewritten["content"] = content + "\n" + text if content else text
        out.append(rewritten)
    flush_results()
    return out


def _result_text(message: dict, names: dict[str, str]) -> str:
    result: dict[str, Any] = {}
    call_id = message.get("tool_call_id")
    name = message.get("name") or names.get(call_id or "")
    if name:
        result["name"] = name
    if call_id:
        result["id"] = call_id
    result["content"] = message.get("content") or ""
    return json.dumps({"tool_response": result}, ensure_ascii=False)
