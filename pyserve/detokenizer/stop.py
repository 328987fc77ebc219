"""Stop strings with hold-back: no part of a stop string ever reaches the client.

Text arrives in pieces. A piece is released only up to the point where its tail could still be
the beginning of a stop string; that tail is held until the next piece shows whether the stop
string really follows (then the text before it is released and the request ends) or not (then
the tail is released too). What is held is always shorter than the longest stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    __slots__ = ("held", "include_stop", "max_hold", "stops")

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self.include_stop = include_stop
        self.max_hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns the text safe to release now, and the stop string if one has just completed.

        After a match the caller ends the request: the text after the stop string is dropped.
        """
        if not self.stops:
            return text, None
        buffer = self.held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self.held = ""
            end = start + len(stop) if self.include_stop else start
            return buffer[:end], stop
        keep = self._partial_tail(buffer)
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """The held tail, released when the request ends for another reason (EOS, length)."""
        held, self.held = self.held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        # The stop that completes first wins, as it would if text came one character at a time
        # (so the result does not depend on how the text was cut); at the same end, the longer.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = min(self.max_hold, len(buffer))
        for n in range(longest, 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self.stops):
                return n
        return 0
