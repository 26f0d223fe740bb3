"""Host tier: a pre-allocated pool of block rows in host memory (pinned on CUDA), LRU.

Rows are `BlockMover.block_nbytes` wide, so one slot holds one block of every
layer. The pool is allocated once at start-up: a tier that could not hold its
size fails at start, not under load. The LRU bookkeeping is `LRUIndex`; a slot
with a load pending is pinned.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.kv.tiers.lru import LRUIndex


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, block_nbytes: int, pin_memory: bool = False) -> None:
        slots = capacity_bytes // block_nbytes
        if slots < 1:
            raise ValueError(f"kv_offload_memory={capacity_bytes} bytes holds no KV block (one block is {block_nbytes} bytes)")
        self.block_nbytes = block_nbytes
        self.pool = torch.empty(slots, block_nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.index: LRUIndex[tuple[int, tuple[int, ...]]] = LRUIndex(slots)  # key -> (slot, token ids)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.bytes_written = self.bytes_read = 0

    @property
    def num_slots(self) -> int:
        return self.pool.shape[0]

    @property
    def capacity(self) -> int:
        return self.num_slots * self.block_nbytes

    @property
    def used(self) -> int:
        return self.index.used * self.block_nbytes

    def contains(self, key: bytes) -> bool:
        return key in self.index

    def lookup(self, key: bytes, token_ids: Sequence[int]) -> int | None:
        """The slot holding exactly this block (token ids confirmed), or None."""
        entry = self.index.get(key)
        if entry is None or entry[1] != tuple(token_ids):
            return None
        return entry[0]

    def reserve(self, key: bytes, token_ids: Sequence[int]) -> int | None:
        """A slot for a new entry (evicting LRU entries); None when the key is stored already or every slot is pinned."""
        if key in self.index:  # content-addressed: the same key holds the same bytes already
            self.index.get(key)
            return None
        evicted = self.index.make_room(1)
        if evicted is None:
            return None
        self.free_slots.extend(slot for _, (slot, _) in evicted)
        slot = self.free_slots.pop()
        self.index.add(key, (slot, tuple(token_ids)), 1)
        return slot

    def put_rows(self, entries: Sequence[tuple[bytes, Sequence[int]]], rows: torch.Tensor) -> None:
        """Store rows[i] under entries[i] = (key, token ids)."""
        slots, picked = [], []
        for i, (key, tokens) in enumerate(entries):
            slot = self.reserve(key, tokens)
            if slot is not None:
                slots.append(slot)
                picked.append(i)
        if slots:
            src = rows if len(picked) == len(entries) else rows[torch.tensor(picked)]
            self.pool.index_copy_(0, torch.tensor(slots), src.to("cpu"))
            self.bytes_written += len(slots) * self.block_nbytes

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        self.bytes_read += len(slots) * self.block_nbytes
        return self.pool.index_select(0, torch.tensor(list(slots)))
