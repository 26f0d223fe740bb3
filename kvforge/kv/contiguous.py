"""Contiguous per-sequence reservation: what a naive server does, kept as a mode to measure against.

A naive server gives each admitted sequence one contiguous region of `max_model_len`
token slots, because it cannot know how long the sequence will grow. Here that is a
`GroupManager` whose first allocation for a request takes every block up to
`max_model_len` at once (same bytes as one region; attention reads only the filled
slots), installed in the coordinator by `ContiguousKVCacheCoordinator`
(`kv_allocation="contiguous"`). Nothing else changes, so greedy outputs are identical
to paged mode, and the difference is purely how much memory sits reserved but unused,
and therefore how many sequences fit. `kvforge learn paging` runs both modes on the
same workload. Pure Python.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvforge.config import KV_ALLOCATIONS
from kvforge.kv.blocks import BlockPool
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.kv.group_manager import GroupManager
from kvforge.kv.interface import KVRequest
from kvforge.ledger import KVGroup

__all__ = ["KV_ALLOCATIONS", "ContiguousGroupManager", "ContiguousKVCacheCoordinator", "make_coordinator"]


class ContiguousGroupManager(GroupManager):
    """A full-attention group that reserves ceil(max_model_len / block_size) blocks for a request at admission."""

    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int) -> None:
        super().__init__(pool, block_size, sliding_window=None)
        self.reserve_blocks = -(-max_model_len // block_size)
        if self.reserve_blocks > pool.num_blocks:
            raise ValueError(
                f"kv_allocation='contiguous' reserves {self.reserve_blocks} blocks (max_model_len={max_model_len}) "
                f"per sequence but the KV cache has {pool.num_blocks}; lower max_model_len or raise kv_cache_memory"
            )

    def blocks_needed(self, req: KVRequest, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        held = len(self.tables.get(req.request_id, ())) + num_computed_blocks
        return max(super().blocks_needed(req, num_new_tokens, num_computed_blocks), self.reserve_blocks - held)

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """The child shares the prompt's blocks only; it reserves its own future slots at its next allocation.

        Sharing the parent's reserved-but-empty blocks would let both samples write the same slots
        (copy-on-write only guards the partly filled block).
        """
        super().fork(parent, child)
        table = self.tables[child.request_id]
        keep = -(-parent.num_tokens // self.block_size)  # the prompt, fully computed once this step runs
        self.pool.free_blocks(list(reversed(table[keep:])))  # drops the child's references only
        del table[keep:]


class ContiguousKVCacheCoordinator(KVCacheCoordinator):
    """The coordinator with its one full-attention group reserving `max_model_len` slots per sequence."""

    def __init__(self, groups: Sequence[KVGroup], block_size: int, enable_caching: bool, max_model_len: int) -> None:
        if len(groups) != 1 or groups[0].window is not None:
            raise ValueError("kv_allocation='contiguous' supports models with one full-attention KV cache group only")
        super().__init__(groups, block_size, enable_caching)
        self.managers[0] = ContiguousGroupManager(self.managers[0].pool, block_size, max_model_len)


def make_coordinator(
    groups: Sequence[KVGroup], block_size: int, enable_caching: bool, kv_allocation: str = "paged",
    max_model_len: int | None = None,
) -> KVCacheCoordinator:
    """The engine's coordinator for `kv_allocation` ("paged": the plain one)."""
    if kv_allocation == "paged":
        return KVCacheCoordinator(groups, block_size, enable_caching)
    if kv_allocation == "contiguous" and max_model_len is not None:
        return ContiguousKVCacheCoordinator(groups, block_size, enable_caching, max_model_len)
    raise ValueError(f"kv_allocation must be one of {KV_ALLOCATIONS} (contiguous needs max_model_len), "
                     f"got {kv_allocation!r}")
