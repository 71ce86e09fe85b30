"""Text shown while it streams: a tail that may still become a stop string or a marker is held back
until it does or cannot. Free of torch, as the server's parsers (and the body parser's children, through
the request models) import it."""

from __future__ import annotations

from typing import Sequence


def hold_back_stop_prefix(text: str, stops: Sequence[str]) -> str:
    """While a request runs, hide a tail that could be the start of a stop string (it may be cut).
    The server's reasoning and tool-call parsers hold back a tail that could begin a marker the same way."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[:len(text) - hold] if hold else text
