"""Stop strings on streamed text: never release part of one, cut at the first match.

Only text that can no longer change is released, so the concatenation of every push plus the final flush
equals the whole text cut at its first stop string, however the text was split into deltas.
"""
from __future__ import annotations

from typing import Iterable


def partial_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class StopStringFilter:
    """Cuts the text at the first stop string and never releases part of one.

    A suffix that could still grow into a stop string is held back until the next push proves otherwise.
    After a match, `matched` holds the stop string and everything later is dropped.
    """

    def __init__(self, stops: Iterable[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [(buf.find(s), s) for s in self._stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, self.matched = min(hits)
            self._held = ""
            return buf[:index]
        keep = partial_suffix_len(buf, self._stops)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
