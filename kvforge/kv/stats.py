"""Prefix-cache hit statistics, in tokens. Pure Python."""
from __future__ import annotations

from collections import deque


class PrefixCacheStats:
    """Prefix-cache lookups in tokens, recorded once per admission.

    Preempted requests' recompute is counted apart: re-admitting a preempted
    request mostly hits its own freed blocks, which would inflate the rate.
    The recent window covers the last `window_size` first admissions.
    """

    def __init__(self, window_size: int = 1000) -> None:
        self.queries = self.hits = 0
        self.recompute_queries = self.recompute_hits = 0
        self.window: deque[tuple[int, int]] = deque(maxlen=window_size)  # (queried, hit) per admission
        self._window_queries = self._window_hits = 0

    def record(self, queried: int, hit: int, recompute: bool) -> None:
        if recompute:
            self.recompute_queries += queried
            self.recompute_hits += hit
            return
        self.queries += queried
        self.hits += hit
        if len(self.window) == self.window.maxlen:
            q, h = self.window[0]
            self._window_queries -= q
            self._window_hits -= h
        self.window.append((queried, hit))
        self._window_queries += queried
        self._window_hits += hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def recent_hit_rate(self) -> float:
        return self._window_hits / self._window_queries if self._window_queries else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"queries": self.queries, "hits": self.hits, "hit_rate": self.hit_rate,
                "recent_hit_rate": self.recent_hit_rate, "recompute_queries": self.recompute_queries,
                "recompute_hits": self.recompute_hits}
