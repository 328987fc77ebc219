"""Writing a stream's mid-stream SSE events from the step callback, not from its handler.

At stream interval 1 every step hands each of (say) 256 streams one token. Sent the usual way,
each token wakes its handler's task, climbs the generator chain (``Engine.generate`` → merge →
handler) and awaits aiohttp's writer: most of the event loop's work per token. The sink built
here is installed on the request's state (``Engine.stream_directly``) and writes the event
right where the step's deltas land, one ``transport.write`` of the bytes the handler would have
written, and records the chunk as the handler would have (latency metrics, the choice's result).

It declines (the chunk then goes to the handler as before) whenever the connection cannot take
the write at once: headers not yet out, a full send buffer, a closing transport. Everything
that is not a plain content event never reaches it: final chunks, errors and aborts always go
to the handler, and the handler only installs it for a single choice without logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pyserve.http.metrics import RequestLatencies
from pyserve.http.sse import SSEStream
from pyserve.outputs import GenerationChunk

if TYPE_CHECKING:
    from pyserve.http.pipeline import ChoiceResult, Format


def direct_events(
    sse: SSEStream,
    fmt: Format,
    result: ChoiceResult,
    latency: RequestLatencies,
) -> Callable[[GenerationChunk], bool]:
    """A sink for choice 0's mid-stream chunks; True when it took the chunk."""

    def take(chunk: GenerationChunk) -> bool:
        frame = fmt.content(0, chunk, None)  # without logprobs: a pure render, safe to repeat
        if frame is not None and not sse.write_now(frame):
            return False
        latency.chunk(chunk)
        result.add(chunk)
        return True

    return take
