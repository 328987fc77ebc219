"""Incremental detokenization, batched over the requests of a step.

The prefix/read-offset technique: each request keeps a short window of recent token ids. The text
of ``window[:read]`` has already been emitted; decoding ``window`` and ``window[:read]`` and taking
the difference gives the new text. Decoding a few tokens of left context (instead of the new
tokens alone) keeps tokenizer-specific joins right, e.g. SentencePiece's leading space.

A byte-level token can hold part of a UTF-8 character (emoji, CJK); the decoder then renders the
incomplete tail as U+FFFD. New text that ends in U+FFFD is held back until the character completes,
so nothing emitted is ever half a character. The window is cut to what is not yet emitted after
each emission, which keeps per-request state to a handful of tokens however long the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Left context taken from the prompt, so the first output token joins the prompt correctly.
PROMPT_CONTEXT_TOKENS = 4
# A UTF-8 character has at most 4 bytes, so a real one completes within a few tokens; a longer
# run that still ends in U+FFFD is invalid UTF-8 (a model emitting stray bytes) and is released
# as it is, which also bounds the window.
MAX_PENDING_TOKENS = 8


class IncrementalDecoder:
    """One request's decoding state: a window of token ids and two offsets into it."""

    __slots__ = ("prefix_offset", "read_offset", "skip_special_tokens", "window")

    def __init__(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.window: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the left context
        self.read_offset = len(self.window)  # everything before it has been emitted
        self.skip_special_tokens = skip_special_tokens

    def append(self, token_id: int) -> None:
        self.window.append(token_id)

    @property
    def pending_tokens(self) -> int:
        return len(self.window) - self.read_offset

    def _advance(self, emitted_text: str) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.window)
        del self.window[: self.prefix_offset]  # keep only the new left context
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        return emitted_text


def decode_step(
    tokenizer: Tokenizer, decoders: Sequence[IncrementalDecoder], final: Sequence[bool]
) -> list[str]:
    """New text of every decoder whose window grew, decoded in one batch per special-token mode.

    ``final[i]`` releases everything of decoder ``i``, an incomplete character included (as
    U+FFFD, exactly what a full decode would show), because no more tokens will come.
    """
    out = [""] * len(decoders)
    for skip in (True, False):
        members = [
            i for i, d in enumerate(decoders) if d.skip_special_tokens == skip and d.pending_tokens
        ]
        if not members:
            continue
        batch = [decoders[i].window[: decoders[i].read_offset] for i in members]
        batch += [decoders[i].window for i in members]
        texts = tokenizer.decode_batch(batch, skip_special_tokens=skip)
        n = len(members)
        for k, i in enumerate(members):
            out[i] = _new_text(decoders[i], texts[k], texts[n + k], final[i])
    return out


def _new_text(decoder: IncrementalDecoder, prefix_text: str, full_text: str, final: bool) -> str:
    if final or decoder.pending_tokens > MAX_PENDING_TOKENS:
        return decoder._advance(full_text[len(prefix_text) :])
    if full_text.endswith(REPLACEMENT_CHAR):
        return ""  # a character is still incomplete: wait for more tokens
    return decoder._advance(full_text[len(prefix_text) :])
