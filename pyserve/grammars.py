"""A request's ``Grammar`` in llguidance's terms, and its validation before admission.

Shared by the main process (which checks a grammar before the request reaches the scheduler,
so that a malformed one is a 400 naming the problem) and the worker (which builds a matcher from
the same text). llguidance compiles JSON schemas, regular expressions and Lark grammars (GBNF is
translated to Lark); the lexer over the vocabulary is built lazily, on the worker's first masks.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from threading import Lock

from pyserve.wire.main_to_worker import Grammar, InvalidSampling

# JSON is generated compactly, with Python's json.dumps separators: flexible whitespace would
# let a model emit whitespace forever, and the parsed value is the same either way.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
_CHECKED_CACHE = 512  # grammars whose check result is kept


def llguidance_grammar(grammar: Grammar) -> str:
    """The llguidance grammar text of ``grammar``; ValueError if it cannot be translated."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    kind, text = grammar.kind, grammar.text
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, JSON_OPTIONS)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(text, JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "ebnf":
        return LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    return LLMatcher.grammar_from_lark(text)


def after_thought(
    grammar: Grammar,
    start: str,
    end: str,
    *,
    opened: bool,
    added_tokens: Mapping[str, int] | None = None,
    answer_opening: str = "",
) -> Grammar:
    """``grammar`` applied to the answer of a reasoning model: the output may first think
    (``start`` ... ``end``, the thought free and ending at the first ``end``), then must follow
    ``grammar``. ``opened``: the prompt already opened the thought, so the output starts in it.
    ``answer_opening``: text that the answer starts with, thought or not (harmony's header of
    its final message).

    JSON and regex grammars become the rule ``answer``; a Lark (or EBNF) grammar keeps its
    rules, its ``start`` renamed ``answer`` (so it must not have rules named ``thought``,
    ``thought_text`` or ``answer``: ValueError).
    """
    from llguidance import regex_to_lark
    from llguidance.gbnf_to_lark import gbnf_to_lark

    tokens = dict(added_tokens or {})
    opening = "" if opened else lark_text(start, tokens) + " "
    closing = lark_text(end, tokens)
    if "<[" in closing:
        # A marker that is a token cannot sit inside a lexeme: the thought's text is a greedy
        # lexeme that the end token (never part of any text) closes.
        thought = f"thought_text: /(.|\\n)*/\nthought: {opening}thought_text {closing}\n"
    else:  # the thought ends at the first spelling of the end marker
        thought = f"thought_text[lazy]: /(.|\\n)*/ {closing}\nthought: {opening}thought_text\n"

    optional = "" if opened else "?"
    lead = lark_text(answer_opening, tokens) + " " if answer_opening else ""
    if grammar.kind in ("json_object", "json_schema", "regex"):
        if grammar.kind == "regex":
            answer = f"/{regex_to_lark(grammar.text)}/"
        else:
            answer = f"%json {_with_options(grammar.text or ANY_JSON_OBJECT)}"
        return Grammar(
            "lark", f"start: thought{optional} {lead}answer\n{thought}answer: {answer}\n"
        )
    text = gbnf_to_lark(grammar.text) if grammar.kind == "ebnf" else grammar.text
    rules = set(re.findall(r"(?m)^\s*([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\s*:", text))
    if "start" not in rules or rules & {"thought", "thought_text", "answer"}:
        raise ValueError(
            f"a {_describe(grammar)} after a thought needs a start rule, and no rules named "
            "thought, thought_text or answer"
        )
    answer = re.sub(r"(?m)^(\s*)start(\s*(?:\[[^\]]*\])?\s*:)", r"\1answer\2", text)
    return Grammar("lark", f"{answer}\nstart: thought{optional} {lead}answer\n{thought}")


def lark_text(text: str, added_tokens: Mapping[str, int]) -> str:
    """``text`` as Lark terminals: literals, and the tokenizer's added tokens by id ("" for no
    text). An added token, special or not (Qwen's ``<tool_call>`` and ``<think>`` are not), is
    one piece of the vocabulary that llguidance never spells as text: a literal ``<tool_call>``
    could only be written piece by piece, and llguidance's forced-token shortcut would even let
    the added token through only to reject it. At each place the longest added token wins."""
    if not text:
        return ""
    best: tuple[int, int, str] | None = None  # (position, -length, token text)
    for token in added_tokens:
        at = text.find(token) if token else -1
        if at >= 0 and (best is None or (at, -len(token)) < best[:2]):
            best = (at, -len(token), token)
    if best is None:
        return json.dumps(text, ensure_ascii=False)
    at, _, token = best
    parts = (
        lark_text(text[:at], added_tokens),
        f"<[{added_tokens[token]}]>",
        lark_text(text[at + len(token) :], added_tokens),
    )
    return " ".join(p for p in parts if p)


def _with_options(schema_text: str) -> str:
    """The schema with this module's JSON options, as llguidance reads them inside Lark."""
    schema = json.loads(schema_text)
    if isinstance(schema, dict):
        schema.setdefault("x-guidance", JSON_OPTIONS)
    return json.dumps(schema)


def schema_error(schema: object) -> str | None:
    """What makes ``schema`` an invalid JSON Schema (against its own draft's meta-schema, 2020-12
    by default), or None: a valid schema may still use what the grammar engine lacks."""
    from jsonschema import SchemaError, validators

    if not isinstance(schema, dict | bool):
        return "a JSON Schema is an object or a boolean"
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        return exc.message
    return None


def grammar_problem(grammar: Grammar) -> str | None:
    """What is wrong with ``grammar`` (a JSON schema llguidance cannot enforce, a regex or
    grammar that does not compile), or None. Builds the grammar without the vocabulary."""
    from llguidance import LLMatcher

    try:
        text = llguidance_grammar(grammar)
    except Exception as exc:  # malformed JSON, GBNF that does not translate
        return str(exc) or type(exc).__name__
    return LLMatcher.validate_grammar(text) or None


class GrammarChecker:
    """``grammar_problem`` with its answers cached by grammar (compiling is milliseconds to
    seconds; a schema sent with every request is checked once). Thread-safe."""

    def __init__(self, capacity: int = _CHECKED_CACHE) -> None:
        self._capacity = capacity
        self._answers: OrderedDict[Grammar, str | None] = OrderedDict()
        self._lock = Lock()

    def known(self, grammar: Grammar) -> bool:
        """Whether ``check`` would answer from the cache (without compiling)."""
        with self._lock:
            return grammar in self._answers

    def check(self, grammar: Grammar, param: str) -> None:
        """Raises InvalidSampling naming ``param`` when the grammar cannot be enforced."""
        with self._lock:
            known = grammar in self._answers
            if known:
                self._answers.move_to_end(grammar)
                problem = self._answers[grammar]
        if not known:
            problem = grammar_problem(grammar)
            with self._lock:
                self._answers[grammar] = problem
                while len(self._answers) > self._capacity:
                    self._answers.popitem(last=False)
        if problem is not None:
            raise InvalidSampling(
                f"{param}: the {_describe(grammar)} is not usable: {problem}", param
            )


def _describe(grammar: Grammar) -> str:
    return {
        "json_schema": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regular expression",
        "ebnf": "EBNF grammar",
        "lark": "Lark grammar",
    }[grammar.kind]
