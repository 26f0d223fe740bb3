"""LRU bookkeeping shared by the host and disk tiers. Pure Python.

Entries have a size in units (host: slots, disk: bytes); the index never holds
more than `capacity` units. A pinned entry (a load is pending from it) is never
evicted, so a scheduled hit cannot be overwritten before its bytes are read.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUIndex(Generic[V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()  # oldest first
        self.pins: dict[Hashable, int] = {}
        self.used = 0
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Hashable, touch: bool = True) -> V | None:
        item = self.entries.get(key)
        if item is None:
            return None
        if touch:
            self.entries.move_to_end(key)
        return item[0]

    def make_room(self, size: int) -> list[tuple[Hashable, V]] | None:
        """Evict least-recent unpinned entries until `size` more units fit; None (nothing changed) if they cannot."""
        if size > self.capacity:
            return None
        need, victims = self.used + size - self.capacity, []
        for key, (_, esize) in self.entries.items():
            if need <= 0:
                break
            if not self.pins.get(key):
                victims.append(key)
                need -= esize
        if need > 0:
            return None
        self.evictions += len(victims)
        return [(key, self._drop(key)[0]) for key in victims]

    def _drop(self, key: Hashable) -> tuple[V, int]:
        value, size = self.entries.pop(key)
        self.used -= size
        return value, size

    def add(self, key: Hashable, value: V, size: int) -> None:
        """Insert after `make_room(size)` succeeded (an existing key is replaced)."""
        if key in self.entries:
            self._drop(key)
        assert self.used + size <= self.capacity, "add without make_room"
        self.entries[key] = (value, size)
        self.used += size

    def remove(self, key: Hashable) -> V | None:
        if key not in self.entries:
            return None
        self.pins.pop(key, None)
        return self._drop(key)[0]

    def pin(self, key: Hashable) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        n = self.pins.get(key, 0) - 1
        if n > 0:
            self.pins[key] = n
        else:
            self.pins.pop(key, None)
