"""Driving an API format (pyserve/http/*_format.py) as the pipeline does, without a server."""

from __future__ import annotations

from pyserve.chat.output import ChatOutput
from pyserve.http.pipeline import ChoiceResult
from pyserve.outputs import GenerationChunk


def pipeline_frames(
    fmt,
    output: ChatOutput | None,
    pieces: list[str],
    chunks: list[GenerationChunk],
    finish: str,
    *,
    ping: bool = False,
) -> list[bytes]:
    """The frames that pyserve.http.pipeline.Pipeline._stream writes through ``fmt`` for one
    choice generated as ``pieces`` (each with its chunk; the last one carries ``finish``), its
    text parsed by ``output`` where given; ``ping``: one ping while the prompt prefills."""
    parser = output.stream() if output is not None else None
    result = ChoiceResult()
    frames = [*fmt.preamble(), *([fmt.ping()] if ping else []), *fmt.opening(0)]
    for piece, c in zip(pieces, chunks, strict=True):
        result.add(c)
        delta = parser.feed(piece) if parser is not None and piece else None
        frame = fmt.content(0, c, delta)
        if frame is not None:
            frames.append(frame)
    held, reason = None, finish
    if parser is not None:
        held, reason = parser.finish(), parser.finish_reason(finish)
    frames += fmt.closing(0, result, held, reason)
    frames += fmt.end([result])
    return frames
