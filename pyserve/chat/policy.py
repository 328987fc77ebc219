"""The chat policy of one served model: how its outputs are read back into turns.

Which tool-call format its template writes (``--tool-call-parser``; auto: the template's own,
or the generic format when it has none), which reasoning parser splits off its thoughts, which
of its tokens are added or special (a grammar names those by id; a parser must see the special
ones), and whether a rendered prompt leaves the output inside a thought. A harmony model
(gpt-oss: its tokenizer has the format's special tokens, its template writes channels) needs
no flag: its whole turn is read by the harmony reader, thought and calls alike. Only the HTTP
chat code asks: the engine itself knows nothing of chat formats.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pyserve.chat.harmony import HARMONY, is_harmony, turn_end_ids
from pyserve.chat.reasoning import REASONING_PARSERS, ReasoningParser
from pyserve.chat.tool_calls import PARSERS, ToolCallParser, parser_for_template

_THOUGHT_TAIL_TOKENS = 16  # what the end of a prompt is searched for an open thought


class ChatPolicy:
    def __init__(
        self, tokenizer: Any, tool_call_parser: str | None, reasoning_parser: str | None
    ) -> None:
        """``tokenizer``: the model's transformers tokenizer; the parsers by their flag values."""
        self.tokenizer = tokenizer
        self._tool_call_parser = tool_call_parser
        self._reasoning_parser = reasoning_parser

    @functools.cached_property
    def harmony(self) -> bool:
        """Whether outputs are harmony turns: either flag says so, or the model writes them and
        neither flag names another format."""
        flags = (self._tool_call_parser, self._reasoning_parser)
        if HARMONY in flags:
            return True
        if flags[0] not in ("auto", "none") or flags[1] is not None:
            return False
        return is_harmony(self.special_tokens, self.tokenizer.chat_template)

    @functools.cached_property
    def harmony_calls(self) -> bool:
        """Whether a harmony model's calls are read (``--tool-call-parser none`` refuses tools)."""
        return self.harmony and self._tool_call_parser != "none"

    @functools.cached_property
    def turn_end_ids(self) -> list[int]:
        """Tokens that must end a chat turn beside the model's EOS (harmony's)."""
        return turn_end_ids(self.special_tokens) if self.harmony else []

    @property
    def reads_thoughts(self) -> bool:
        """Whether a thought comes back apart from the answer (a request may ask for one)."""
        return self.harmony or self.reasoning_parser is not None

    @functools.cached_property
    def tool_call_parser(self) -> ToolCallParser | None:
        """How this model's tool calls are read; None when they are off (or harmony's)."""
        name = self._tool_call_parser
        if self.harmony:
            return None
        if name == "auto":
            name = parser_for_template(self.tokenizer.chat_template) or "generic"
        return PARSERS[name]() if name and name != "none" else None

    @functools.cached_property
    def reasoning_parser(self) -> ReasoningParser | None:
        """How a ``<think>`` thought is split off; None when it is not (or harmony's)."""
        name = self._reasoning_parser
        if self.harmony:
            return None
        return REASONING_PARSERS[name] if name is not None else None

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """The text of each special token of the vocabulary, and its id."""
        decoder = self.tokenizer.added_tokens_decoder
        return {token.content: i for i, token in decoder.items() if token.special}

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """The text of each added token of the vocabulary (special or not), and its id: what a
        grammar names by id, since the grammar engine never spells one as text."""
        decoder = self.tokenizer.added_tokens_decoder
        return {token.content: i for i, token in decoder.items()}

    def prompt_opens_thought(self, prompt_ids: Sequence[int], parser: ReasoningParser) -> bool:
        """Whether a rendered prompt ends inside a thought (the template opened ``<think>``),
        so that the output starts in it; a prompt that closed it (thinking disabled) does not.
        """
        tail = self.tokenizer.backend_tokenizer.decode(
            list(prompt_ids[-_THOUGHT_TAIL_TOKENS:]), skip_special_tokens=False
        )
        opened, closed = tail.rfind(parser.start), tail.rfind(parser.end)
        if opened < 0 and closed < 0:
            return parser.starts_inside
        return opened > closed
