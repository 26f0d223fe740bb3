"""Stop strings: end generation at the first occurrence, across token boundaries.

A stop string can arrive split over several tokens ("\\n\\nUser" as "\\n", "\\nUs",
"er"), so matching runs on the text, not the tokens. Text that might be the
beginning of a stop string is held back until later text rules it in or out --
otherwise a streamed client would already have shown part of the stop string.
The stop string itself is not emitted (vLLM's default) unless asked.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopCheck(NamedTuple):
    """`text`: safe to emit now; `stop_index`: where the output ends (None: keep generating)."""

    text: str
    stop_index: int | None


class StopStringMatcher:
    """Finds the earliest stop string in a growing output text."""

    def __init__(self, stops: Sequence[str] | None, include_stop_str_in_output: bool = False):
        if stops is None:
            stops = []
        if isinstance(stops, str) or not isinstance(stops, (list, tuple)):
            raise ValueError(f"stop must be a list of non-empty strings, got {type(stops).__name__}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got element {s!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.include = include_stop_str_in_output
        # Longest text that could still grow into a stop string: held back from streaming.
        self._max_hold = max((len(s) - 1 for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def check(self, text: str, emitted: int) -> StopCheck:
        """Given the full output `text` and how many characters were already emitted, what to emit now.

        With a stop hit, `stop_index` is the length the final output text must be
        cut to, and `text` is everything up to there not yet emitted. Matches can
        only start at or after `emitted`: earlier text was released only once it
        could no longer begin a stop string.
        """
        assert 0 <= emitted <= len(text), (emitted, len(text))
        hit, hit_stop = None, ""
        for stop in self.stops:
            i = text.find(stop, emitted)
            if i != -1 and (hit is None or i < hit):
                hit, hit_stop = i, stop
        if hit is not None:
            end = hit + len(hit_stop) if self.include else hit
            return StopCheck(text[emitted:end], end)
        return StopCheck(text[emitted:len(text) - self._partial_suffix(text, emitted)], None)

    def matched_stop(self, text: str, stop_index: int) -> str | None:
        """Which stop string ended the output at `stop_index` (for `stop_reason` in responses)."""
        for stop in self.stops:
            start = stop_index - len(stop) if self.include else stop_index
            if start >= 0 and text.startswith(stop, start):
                return stop
        return None

    def _partial_suffix(self, text: str, emitted: int) -> int:
        """Length of the longest tail of text[emitted:] that is a proper prefix of some stop string."""
        tail_max = min(self._max_hold, len(text) - emitted)
        for n in range(tail_max, 0, -1):
            tail = text[len(text) - n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
