"""Holding back text that may be the start of a marker, while a stream is read."""

from __future__ import annotations


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
