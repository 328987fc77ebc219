"""A model's thinking split from its answer: ``<think>...</think>`` (DeepSeek-R1, Qwen3).

Rules, the same for ``parse`` and for a stream split anywhere:

* The thought opens with the start marker at the very beginning of the output (whitespace
  before it is dropped), or is already open when the prompt opened it (``starts_inside``);
  a start marker there is then skipped, as R1-0528 and some distills write it again.
  Otherwise the whole output is content, a later ``<think>`` included.
* The thought ends at the first end marker; an output that never closes it is all reasoning.
* Newlines right after the end marker are dropped from the content (``strip_newlines``).
  vLLM's deepseek_r1 and qwen3 parsers and SGLang's keep them; pass
  ``strip_newlines=False`` to match them.
* Reasoning is kept as written, its leading and trailing newlines included.
"""

from __future__ import annotations

from pyserve.chat.markers import partial_marker_length


class ReasoningParser:
    """Splits reasoning from content; holds no state, so one instance serves every request."""

    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        starts_inside: bool = False,
        *,
        strip_newlines: bool = True,
    ) -> None:
        if not start or not end:
            raise ValueError("reasoning markers must not be empty")
        self.start = start
        self.end = end
        self.starts_inside = starts_inside  # the prompt already opened the thought
        self.strip_newlines = strip_newlines  # drop newlines right after the end marker

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output; None for an empty part."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            thought = stripped[len(self.start) :]
        elif self.starts_inside:
            thought = text
        else:
            return None, text or None
        reasoning, found, content = thought.partition(self.end)
        if not found:
            return reasoning or None, None
        if self.strip_newlines:
            content = content.lstrip("\r\n")
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        """A new stream for one output."""
        return ReasoningStream(self)


class ReasoningStream:
    """Splits one output as it is generated.

    Text that may be part of a marker (a trailing ``</thi``), whitespace that may precede the
    start marker, and newlines that may be followed by nothing but newlines after the end
    marker are held back until they are settled; ``finish`` releases the rest.
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._state = "prefix"  # prefix: not yet known whether a thought opens
        self._buf = ""
        self.thinking_done = False  # the end marker was seen, or the output has no thought

    def feed(self, delta: str) -> tuple[str, str]:
        """Read the next piece of output; return (reasoning, content) to emit now."""
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: return what was held back, as feed() does."""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        parser = self._parser
        reasoning, content = [], []
        while self._buf:
            buf = self._buf
            if self._state == "prefix":
                stripped = buf.lstrip()
                if stripped.startswith(parser.start):
                    self._buf = stripped[len(parser.start) :]
                    self._state = "thought"
                    continue
                if parser.start.startswith(stripped) and not final:
                    break  # only whitespace, or the start marker's beginning, so far
                if parser.starts_inside:
                    self._state = "thought"
                else:
                    self._state, self.thinking_done = "content", True
            elif self._state == "thought":
                at = buf.find(parser.end)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self._buf = buf[at + len(parser.end) :]
                    self._state, self.thinking_done = "after", True
                    continue
                keep = 0 if final else partial_marker_length(buf, parser.end)
                reasoning.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            elif self._state == "after":
                if parser.strip_newlines:
                    self._buf = buf.lstrip("\r\n")
                if self._buf:
                    self._state = "content"
            else:
                content.append(buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    # R1's chat template ends the prompt with "<think>\n", so the output starts in the thought.
    "deepseek_r1": ReasoningParser(starts_inside=True),
    # Qwen3 writes <think> itself; with enable_thinking=False the prompt carries an empty thought.
    "qwen3": ReasoningParser(starts_inside=False),
}
