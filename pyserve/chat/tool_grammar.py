"""The Lark grammar that makes a model write tool calls in its format (for llguidance).

``tool_choice: "required"`` or a named function must produce a call that parses, even from a
model that has never seen the format: the grammar spells the format's markers (the generic
format's are JSON, ``{"tool_calls": [...]}``), and each call's object is ``{"name": <one of the
tools>, "arguments": <that tool's parameters schema>}``, through llguidance's ``%json`` (a JSON
schema inside a Lark rule). With ``auto`` and a response format, the answer is either tool calls
or the response's JSON (in the generic format, without one: calls or its reply object)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from pyserve.chat.tool_calls import CallFormat
from pyserve.grammars import JSON_OPTIONS, lark_text

ANY_OBJECT: dict = {"type": "object"}
# The pieces llguidance's JSON is lexed into (with JSON_OPTIONS' separators).
_JSON_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|: |, |[{}\[\]]')


def tool_calls_lark(
    fmt: CallFormat,
    tools: Sequence[tuple[str, dict | None]],
    *,
    parallel: bool,
    added_tokens: Mapping[str, int] | None = None,
) -> str:
    """A Lark grammar whose sentences are one call (``parallel=False``) or one or more calls of
    ``tools`` ((name, parameters schema) pairs; None means any object), written as ``fmt`` says.

    ``added_tokens`` maps the text of the tokenizer's added tokens (special or not) to their
    ids: a marker such as Mistral's ``[TOOL_CALLS]`` or Qwen's ``<tool_call>`` is a single added
    token, which no spelling in plain text can produce, so the grammar names it by id.
    """
    if not tools:
        raise ValueError("no tools to call")
    specials = dict(added_tokens or {})
    separator = _marker(fmt.separator, specials)
    calls = f"call ({separator} call)*" if parallel else "call"
    rules = [
        _rule("tool_calls", _marker(fmt.begin, specials), calls, _marker(fmt.end, specials)),
        _rule(
            "call",
            _marker(fmt.call_prefix, specials),
            "call_object",
            _marker(fmt.call_suffix, specials),
        ),
        f"call_object: %json {json.dumps(call_schema(fmt, tools))}",
    ]
    return "start: tool_calls\n" + "\n".join(rules) + "\n"


def _marker(text: str, added_tokens: Mapping[str, int]) -> str:
    """A marker as Lark terminals. One that is JSON text (the generic format's
    ``{"tool_calls": [``) is written piece by piece, as llguidance lexes a JSON answer: the
    lexer does not back out of a longer literal, so an answer object beside one literal
    ``{"tool_calls": [`` could never get past ``{"``."""
    pieces = _JSON_PIECE.findall(text)
    if not text or "".join(pieces) != text or any(t and t in text for t in added_tokens):
        return lark_text(text, added_tokens)
    return " ".join(json.dumps(piece, ensure_ascii=False) for piece in pieces)


def _rule(name: str, *parts: str) -> str:
    return f"{name}: " + " ".join(p for p in parts if p)


def tool_calls_or_json_lark(tool_calls: str, answer_schema: dict | None) -> str:
    """Either the tool calls of ``tool_calls`` (a grammar from ``tool_calls_lark``) or a JSON
    answer under ``answer_schema`` (None: any object)."""
    answer = dict(answer_schema or ANY_OBJECT)
    answer.setdefault("x-guidance", JSON_OPTIONS)
    body = tool_calls.removeprefix("start: tool_calls\n")
    return f"start: tool_calls | answer\nanswer: %json {json.dumps(answer)}\n{body}"


def call_schema(fmt: CallFormat, tools: Sequence[tuple[str, dict | None]]) -> dict:
    """The JSON schema of one call object: its name first (what a stream announces first)."""
    options = [
        {
            "type": "object",
            "properties": {
                fmt.name_key: {"const": name},
                fmt.arguments_key: parameters if parameters is not None else ANY_OBJECT,
            },
            "required": [fmt.name_key, fmt.arguments_key],
            "additionalProperties": False,
        }
        for name, parameters in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}
