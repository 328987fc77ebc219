"""The grammars that hold a harmony model (gpt-oss) to a tool call or to an answer's format.

A forced call (``tool_choice`` ``required`` or a named function) is an optional thought, then
one message to a function, ``<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>``, and its arguments under that tool's schema. The grammar ends there, as
``<|call|>`` would end the turn: a harmony turn makes at most one call. With ``auto`` and a
response format the answer is such a call or a final message holding the format's JSON; with a
format and no tools, the final message follows it (``answer_after_thought``). Every marker is
named by its token id (``lark_text``), since the grammar engine never spells a special token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from pyserve.chat.tool_grammar import ANY_OBJECT
from pyserve.grammars import JSON_OPTIONS, after_thought, lark_text
from pyserve.wire.main_to_worker import Grammar

THOUGHT = "<|channel|>analysis<|message|>"
THOUGHT_END = "<|end|><|start|>assistant"  # the next message's header follows
FINAL = "<|channel|>final<|message|>"


def call_header(name: str) -> str:
    """How gpt-oss opens a call of function ``name`` (what its own outputs write)."""
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


def calls_lark(
    tools: Sequence[tuple[str, dict | None]],
    added_tokens: Mapping[str, int],
    *,
    answer: bool = False,
    answer_schema: dict | None = None,
) -> str:
    """A Lark grammar: an optional thought, then a call of one of ``tools`` ((name, parameters
    schema) pairs; None: any object), or with ``answer`` a final message whose text is JSON
    under ``answer_schema`` (None: any object)."""
    if not tools:
        raise ValueError("no tools to call")
    options = [f"call_{i}" for i in range(len(tools))]
    rules = [
        f"thought: {lark_text(THOUGHT, added_tokens)} thought_text "
        f"{lark_text(THOUGHT_END, added_tokens)}",
        "thought_text: /(.|\\n)*/",  # a greedy text that the end token (never text) closes
    ]
    for i, (name, parameters) in enumerate(tools):
        rules.append(f"call_{i}: {lark_text(call_header(name), added_tokens)} arguments_{i}")
        rules.append(f"arguments_{i}: %json {_schema_text(parameters)}")
    if answer:
        options.append("final")
        rules.append(f"final: {lark_text(FINAL, added_tokens)} final_json")
        rules.append(f"final_json: %json {_schema_text(answer_schema)}")
    return "start: thought? answer\nanswer: " + " | ".join(options) + "\n" + "\n".join(rules) + "\n"


def answer_after_thought(grammar: Grammar, added_tokens: Mapping[str, int]) -> Grammar:
    """``grammar`` (a request's format) applied to the text of the final message, after an
    optional thought."""
    return after_thought(
        grammar,
        THOUGHT,
        THOUGHT_END,
        opened=False,
        added_tokens=added_tokens,
        answer_opening=FINAL,
    )


def _schema_text(schema: dict | None) -> str:
    schema = schema if schema is not None else ANY_OBJECT
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})
