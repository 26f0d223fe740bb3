"""A bounded log of what happened to the KV cache, step by step. Pure Python.

Why: a block map shows where blocks are; the events say why they moved there — a prefix hit
and its length, a preemption (recompute or swap), the blocks an eviction policy dropped, tier
loads and stores, copy-on-write copies, cached blocks the pool reclaimed. The `/kv` page and
`kvforge top` read them by sequence number (`since`), so a viewer that polls misses nothing
while the log holds it, and the log never grows past `capacity`.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

EVENT_KINDS = ("admit", "preempt", "evict", "tier_load", "tier_store", "cow", "reclaim")


class KVEventLog:
    def __init__(self, capacity: int = 512) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.next_seq = 0

    def record(self, kind: str, step: int, **data: Any) -> None:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown KV event kind {kind!r}; expected one of {EVENT_KINDS}")
        self.events.append({"seq": self.next_seq, "time": time.time(), "step": step, "kind": kind, **data})
        self.next_seq += 1

    def since(self, seq: int, limit: int | None = None) -> list[dict[str, Any]]:
        """Events with a sequence number >= `seq`, oldest first (the newest `limit` of them)."""
        out = [e for e in self.events if e["seq"] >= seq]
        return out[-limit:] if limit else out

    def extend(self, kind: str, step: int, items: Iterable[dict[str, Any]]) -> None:
        for item in items:
            self.record(kind, step, **item)
