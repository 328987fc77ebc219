"""Grammars without a model: what llguidance accepts for each grammar pyserve builds (tool calls
in every format, answers after a thought), errors for unusable grammars, and the worker's masks.

Each grammar is checked by feeding a matcher the tokens of a text (SmolLM2's tokenizer) and
asking whether it accepts them, so these tests pin down the languages, not the grammar texts.
"""

from __future__ import annotations

import json

import pytest
import torch
from llguidance import LLMatcher, LLTokenizer

from pyserve import model_files
from pyserve.chat.tool_calls import PARSERS
from pyserve.chat.tool_grammar import tool_calls_lark, tool_calls_or_json_lark
from pyserve.grammars import GrammarChecker, after_thought, grammar_problem, llguidance_grammar
from pyserve.wire.main_to_worker import Grammar, InvalidSampling
from pyserve.worker.grammar_masks import GrammarMasks, StepMasks, apply_masks

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", WEATHER), ("now", None)]


@pytest.fixture(scope="module")
def tokenizer_file() -> str:
    source = model_files.resolve_model(None)
    return str(model_files.tokenizer_dir(source) / "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file) -> LLTokenizer:
    with open(tokenizer_file, encoding="utf-8") as f:
        return LLTokenizer(f.read(), eos_token=2)


def accepts(tokenizer: LLTokenizer, grammar: Grammar, text: str, *, complete: bool = True) -> bool:
    """Whether ``text`` (tokenized as a model might write it) is a sentence of ``grammar``
    (``complete``) or the beginning of one."""
    matcher = LLMatcher(tokenizer, llguidance_grammar(grammar), log_level=0)
    for token in tokenizer.tokenize_str(text):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting() if complete else not matcher.is_error()


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_forced_tool_calls_are_what_the_format_parser_reads(tokenizer, fmt: str) -> None:
    parser = PARSERS[fmt]()
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    grammar = Grammar("lark", tool_calls_lark(parser.call_format, TOOLS, parallel=True))
    text = parser.call_format.render(calls)
    assert accepts(tokenizer, grammar, text)
    parsed = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    single = Grammar("lark", tool_calls_lark(parser.call_format, TOOLS, parallel=False))
    assert accepts(tokenizer, single, parser.call_format.render(calls[:1]))
    assert not accepts(tokenizer, single, text)


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny.",  # no call at all
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # not a tool
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3, "days": 1}}\n</tool_call>',
    ],
)
def test_forced_tool_calls_refuse_anything_but_a_valid_call(tokenizer, text: str) -> None:
    fmt = PARSERS["hermes"].call_format
    grammar = Grammar("lark", tool_calls_lark(fmt, TOOLS, parallel=True))
    assert not accepts(tokenizer, grammar, text)


def test_a_special_token_marker_is_named_by_id_not_spelled() -> None:
    fmt = PARSERS["mistral"].call_format
    lark = tool_calls_lark(fmt, TOOLS, parallel=True, added_tokens={"[TOOL_CALLS]": 5})
    assert "<[5]>" in lark and "TOOL_CALLS" not in lark
    assert grammar_problem(Grammar("lark", lark)) is None


def test_auto_with_a_response_format_allows_calls_or_the_json_answer(tokenizer) -> None:
    fmt = PARSERS["hermes"].call_format
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    lark = tool_calls_or_json_lark(tool_calls_lark(fmt, TOOLS, parallel=True), answer)
    grammar = Grammar("lark", lark)
    assert accepts(tokenizer, grammar, fmt.render([("now", {})]))
    assert accepts(tokenizer, grammar, '{"ok": true}')
    assert not accepts(tokenizer, grammar, '{"ok": 1}')


@pytest.mark.parametrize(
    "grammar, answer, wrong",
    [
        (Grammar("json_schema", json.dumps(WEATHER)), '{"city": "Oslo", "days": 2}', '{"c": 1}'),
        (Grammar("json_object"), '{"any": [1, 2]}', "[1, 2]"),
        (Grammar("regex", r"\d{3}-\d{4}"), "555-1234", "5551234"),
        (Grammar("ebnf", 'root ::= "yes" | "no"'), "no", "maybe"),
        (Grammar("lark", 'start: "a"+ "b"'), "aaab", "ba"),
    ],
)
def test_an_answer_grammar_applies_after_the_thought(tokenizer, grammar, answer, wrong) -> None:
    opened = after_thought(grammar, "<think>", "</think>", opened=True)
    assert accepts(tokenizer, opened, f"Let me see </ not yet.\n</think>{answer}")
    assert not accepts(tokenizer, opened, f"Hmm.</think>{wrong}")
    assert not accepts(tokenizer, opened, answer)  # the template opened a thought: it must end
    closed = after_thought(grammar, "<think>", "</think>", opened=False)
    assert accepts(tokenizer, closed, f"<think>Easy.</think>{answer}")
    assert accepts(tokenizer, closed, answer)  # the model may answer without thinking


def test_a_lark_grammar_with_rules_named_like_the_wrapper_is_refused() -> None:
    with pytest.raises(ValueError, match="thought, thought_text or answer"):
        after_thought(
            Grammar("lark", 'start: answer\nanswer: "x"'), "<think>", "</think>", opened=True
        )


@pytest.mark.parametrize(
    "grammar, words",
    [
        (Grammar("json_schema", '{"type": "object", "uniqueItems": true}'), "uniqueItems"),
        (Grammar("json_schema", '{"type": "foo"}'), "foo"),
        (Grammar("json_schema", "{not json"), "line 1"),
        (Grammar("regex", "[a-"), "unclosed character class"),
        (Grammar("lark", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_unusable_grammars_are_refused_with_the_reason(grammar: Grammar, words: str) -> None:
    with pytest.raises(InvalidSampling) as caught:
        GrammarChecker().check(grammar, "response_format")
    assert caught.value.param == "response_format"
    assert words in str(caught.value)


def test_the_checker_compiles_a_grammar_once(monkeypatch) -> None:
    import pyserve.grammars as grammars

    calls = []
    real = grammars.grammar_problem
    monkeypatch.setattr(grammars, "grammar_problem", lambda g: calls.append(g) or real(g))
    checker = GrammarChecker(capacity=2)
    for _ in range(3):
        checker.check(Grammar("regex", "a+"), "regex")
    assert len(calls) == 1
    checker.check(Grammar("regex", "b+"), "regex")
    checker.check(Grammar("regex", "c+"), "regex")
    checker.check(Grammar("regex", "a+"), "regex")  # evicted by the two others
    assert len(calls) == 4


def test_worker_masks_allow_exactly_what_each_grammar_allows(tokenizer_file, tokenizer) -> None:
    vocab = 49152 + 64  # the model's logits may be wider than the tokenizer
    grammars = GrammarMasks(lambda: tokenizer_file, vocab, [2])
    try:
        digits = grammars.start(Grammar("regex", "[0-9]{2}"))
        yes_no = grammars.start(Grammar("ebnf", 'root ::= "yes" | "no"'))
        future = grammars.masks([digits, None, yes_no])
        assert future is not None
        masks = future.result(timeout=60)
        assert masks.rows == [0, 2] and masks.allowed.shape == (2, vocab)
        allowed_digits = {tokenizer.decode_str([t]) for t in masks.allowed[0].nonzero().flatten()}
        assert "7" in allowed_digits and "a" not in allowed_digits
        assert not masks.allowed[:, 49152:].any()
        assert not grammars.advance(digits, tokenizer.tokenize_str("4")[0])
        assert grammars.advance(digits, tokenizer.tokenize_str("2")[0])  # complete: it ends
        assert grammars.masks([digits]) is None  # a finished grammar has no mask
    finally:
        grammars.close()


def test_applied_masks_keep_the_grammars_choice_when_other_bans_leave_nothing() -> None:
    logits = torch.zeros(3, 8)
    logits[2, 4] = float("-inf")  # e.g. min_tokens banned the only token the grammar allows
    allowed = torch.zeros(2, 8, dtype=torch.bool)
    allowed[0, [1, 3]] = True
    allowed[1, 4] = True
    apply_masks(logits, StepMasks.from_allowed([0, 2], allowed))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[1]).all()  # an unconstrained row is untouched
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [4]


# ----------------------------------------------------------------------------- added tokens

# Qwen2.5's and Qwen3's tokenizers add their tool and thought markers as tokens that are not
# flagged special; Mistral's [TOOL_CALLS] is special. Grammars must take both as the model
# writes them: one token each.
ADDED = [("<tool_call>", False), ("</tool_call>", False), ("<think>", False), ("</think>", False)]


@pytest.fixture(scope="module")
def qwen_like(tokenizer_file, tmp_path_factory):
    """SmolLM2's tokenizer with Qwen's markers added as non-special tokens: the HF tokenizer
    (what writes the model's text), llguidance's view of it, and the markers' ids."""
    from tokenizers import AddedToken, Tokenizer

    hf = Tokenizer.from_file(tokenizer_file)
    hf.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in ADDED])
    path = tmp_path_factory.mktemp("qwen-like") / "tokenizer.json"
    hf.save(str(path))
    ids = {text: hf.token_to_id(text) for text, _ in ADDED}
    return hf, LLTokenizer(path.read_text(), n_vocab=hf.get_vocab_size(), eos_token=2), ids


def mask_and_matcher_agree(tokenizer: LLTokenizer, grammar: Grammar, tokens: list[int]) -> bool:
    """Feeds ``tokens`` one by one, checking at each that the mask allows it and that the matcher
    then takes it; True when both hold throughout and the grammar accepts the end."""
    matcher = LLMatcher(tokenizer, llguidance_grammar(grammar), log_level=0)
    for token in tokens:
        allowed = bytearray(matcher.compute_logit_bias())
        if not allowed[token] or not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize("parallel", [False, True])
def test_non_special_added_markers_are_taken_as_the_one_token_the_model_writes(
    qwen_like, parallel: bool
) -> None:
    hf, tokenizer, ids = qwen_like
    fmt = PARSERS["hermes"].call_format
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("now", {})][: 2 if parallel else 1]
    written = hf.encode(fmt.render(calls), add_special_tokens=False).ids
    assert ids["<tool_call>"] in written and ids["</tool_call>"] in written
    added = {text: i for text, i in ids.items()}
    grammar = Grammar("lark", tool_calls_lark(fmt, TOOLS, parallel=parallel, added_tokens=added))
    assert mask_and_matcher_agree(tokenizer, grammar, written)
    # Spelled as a literal, the marker is where llguidance's mask lets the added token through
    # and its matcher then rejects it: the worker's guard against that is tested in
    # test_worker_process.py.
    literal = Grammar("lark", tool_calls_lark(fmt, TOOLS, parallel=parallel))
    assert not mask_and_matcher_agree(tokenizer, literal, written)


def test_a_thought_between_non_special_added_markers_precedes_the_answer(qwen_like) -> None:
    hf, tokenizer, ids = qwen_like
    grammar = after_thought(
        Grammar("json_schema", json.dumps(WEATHER)),
        "<think>",
        "</think>",
        opened=False,
        added_tokens=ids,
    )
    for text in (
        '<think>\nrain?\n</think>{"city": "Oslo", "days": 2}',
        '{"city": "Oslo", "days": 2}',
    ):
        written = hf.encode(text, add_special_tokens=False).ids
        assert mask_and_matcher_agree(tokenizer, grammar, written), text


def test_the_longest_added_token_at_a_place_names_the_marker() -> None:
    from pyserve.grammars import lark_text

    tokens = {"<tool": 7, "<tool_call>": 9, "\n": 4}
    assert lark_text("a<tool_call>\nb", tokens) == '"a" <[9]> <[4]> "b"'
