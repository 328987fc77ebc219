"""Reasoning split (pyserve.chat.reasoning): whole outputs, and streams split anywhere."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyserve.chat.reasoning import REASONING_PARSERS, ReasoningParser

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]

PARSERS = {
    "qwen3": QWEN3,
    "deepseek_r1": R1,
    "qwen3_keep_newlines": ReasoningParser(strip_newlines=False),
    "r1_keep_newlines": ReasoningParser(starts_inside=True, strip_newlines=False),
}


def stream_pieces(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, bool]:
    stream = parser.stream()
    reasoning, content = [], []
    for r, c in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content), stream.thinking_done


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


EXAMPLES = [
    "",
    "\n",
    "Just an answer.",
    "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
    "  <think>x</think>y",
    "<think></think>",
    "<think>\n\n</think>\n\n",
    "<think>still thinking, cut off by max_tokens",
    "<thi",
    "<think",
    "Reasoning without the opening tag.\n</think>\n\nAnswer.",
    "<think>a</think>b</think>c <think>d",
    "Answer that mentions <think> later.",
    "<thinking>is not the marker</thinking>",
    "<think>a </thin k> b </think>\r\n\r\nc",
    "</think>",
    "<think><think>nested</think>after",
    "< think>",
]

PIECES = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a", "\r", "th"]),
    max_size=20,
).map("".join)


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", EXAMPLES)
@settings(max_examples=20, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_a_stream_split_anywhere_gives_what_parse_gives(name, text, cuts):
    parser = PARSERS[name]
    reasoning, content = parser.parse(text)
    assert stream_pieces(parser, split(text, cuts))[:2] == (reasoning or "", content or "")


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=300, deadline=None)
@given(text=PIECES, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_a_stream_of_marker_fragments_gives_what_parse_gives(name, text, cuts):
    parser = PARSERS[name]
    reasoning, content = parser.parse(text)
    assert stream_pieces(parser, split(text, cuts))[:2] == (reasoning or "", content or "")
    assert stream_pieces(parser, list(text))[:2] == (reasoning or "", content or "")


@pytest.mark.parametrize("starts_inside", [False, True])
@settings(max_examples=300, deadline=None)
@given(text=PIECES)
def test_the_parts_and_markers_put_back_together_are_the_output(starts_inside, text):
    parser = ReasoningParser(starts_inside=starts_inside, strip_newlines=False)
    reasoning, content = parser.parse(text)
    r, c = reasoning or "", content or ""
    assert "</think>" not in r
    if text.lstrip().startswith("<think>"):
        assert text.lstrip() in ("<think>" + r + "</think>" + c, "<think>" + r)
    elif starts_inside:
        assert text in (r + "</think>" + c, r)
    else:
        assert reasoning is None and text == c


def test_qwen3_splits_the_thought_from_the_answer():
    text = "<think>\nLet me think.\n</think>\n\nThe answer is 4."
    assert QWEN3.parse(text) == ("\nLet me think.\n", "The answer is 4.")


def test_newlines_after_the_end_marker_can_be_kept_as_vllm_does():
    parser = ReasoningParser(strip_newlines=False)
    assert parser.parse("<think>a</think>\n\nb") == ("a", "\n\nb")


def test_output_without_a_thought_is_all_content():
    assert QWEN3.parse("The answer is 4.") == (None, "The answer is 4.")
    assert QWEN3.parse("Mentions <think> mid-answer.") == (None, "Mentions <think> mid-answer.")
    assert QWEN3.parse("") == (None, None)


def test_an_unclosed_thought_is_all_reasoning():
    assert QWEN3.parse("<think>cut off") == ("cut off", None)
    assert R1.parse("cut off") == ("cut off", None)


def test_r1_output_starts_inside_the_thought():
    assert R1.parse("Hmm.\n</think>\n\nAnswer.") == ("Hmm.\n", "Answer.")


def test_r1_skips_a_repeated_start_marker():
    assert R1.parse("<think>\nHmm.</think>Answer.") == ("\nHmm.", "Answer.")


def test_an_empty_thought_and_empty_answer_are_none():
    assert QWEN3.parse("<think>\n\n</think>\n\n") == ("\n\n", None)
    assert QWEN3.parse("<think></think>") == (None, None)


def test_only_the_first_end_marker_ends_the_thought():
    assert QWEN3.parse("<think>a</think>b</think>c") == ("a", "b</think>c")


def test_a_marker_split_across_deltas_is_held_back():
    stream = QWEN3.stream()
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>Hmm </th") == ("Hmm ", "")
    assert not stream.thinking_done
    assert stream.feed("ink>\n") == ("", "")
    assert stream.thinking_done
    assert stream.feed("\nYes") == ("", "Yes")
    assert stream.finish() == ("", "")


def test_a_false_start_is_released_as_content():
    stream = QWEN3.stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("s is html") == ("", "<this is html")
    assert stream.thinking_done


def test_thinking_is_done_at_once_when_there_is_no_thought():
    stream = QWEN3.stream()
    stream.feed("Answer")
    assert stream.thinking_done
    stream = R1.stream()
    stream.feed("Hmm")
    assert not stream.thinking_done


def test_held_text_is_released_at_the_end():
    stream = QWEN3.stream()
    assert stream.feed("<think>a </thi") == ("a ", "")
    assert stream.finish() == ("</thi", "")


def test_markers_can_be_chosen():
    parser = ReasoningParser("<reasoning>", "</reasoning>")
    assert parser.parse("<reasoning>r</reasoning>c") == ("r", "c")
    with pytest.raises(ValueError):
        ReasoningParser("", "</think>")
