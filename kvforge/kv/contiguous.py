"""Contiguous per-sequence reservation: what a naive server does, kept as a mode to measure against.

A naive server gives each admitted sequence one contiguous region of `max_model_len`
token slots, because it cannot know how long the sequence will grow. Here that is a
`KVCacheManager` whose first allocation for a request takes every block up to
`max_model_len` at once (same bytes as one region; attention reads only the filled
slots). Nothing else changes, so greedy outputs are identical to paged mode, and the
difference is purely how much memory sits reserved but unused, and therefore how many
sequences fit. `kvforge learn paging` runs both modes on the same workload. Pure Python.
"""
from __future__ import annotations

from kvforge.engine.request import Request
from kvforge.kv.blocks import BlockPool
from kvforge.kv.manager import KVCacheManager

KV_ALLOCATIONS = ("paged", "contiguous")


class ContiguousKVCacheManager(KVCacheManager):
    """Reserves ceil(max_model_len / block_size) blocks for a request at admission."""

    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int) -> None:
        super().__init__(pool, block_size, sliding_window=None)
        self.reserve_tokens = max_model_len
        if self.reserve_blocks > pool.num_blocks:
            raise ValueError(
                f"kv_allocation='contiguous' reserves {self.reserve_blocks} blocks (max_model_len={max_model_len}) "
                f"per sequence but the KV cache has {pool.num_blocks}; lower max_model_len or raise kv_cache_memory"
            )

    @property
    def reserve_blocks(self) -> int:
        return -(-self.reserve_tokens // self.block_size)

    def blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        held = len(self.tables.get(req.request_id, ())) + num_computed_blocks
        return max(super().blocks_needed(req, num_new_tokens, num_computed_blocks), self.reserve_blocks - held)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares the prompt's blocks only; it reserves its own future slots at its next allocation.

        Sharing the parent's reserved-but-empty blocks would let both samples write the same slots
        (copy-on-write only guards the partly filled block).
        """
        super().fork(parent, child)
        table = self.tables[child.request_id]
        keep = -(-parent.num_tokens // self.block_size)  # the prompt, fully computed once this step runs
        self.pool.free_blocks(reversed(table[keep:]))  # drops the child's references only
        del table[keep:]


def apply_kv_allocation(kv: object, mode: str, max_model_len: int) -> object:
    """The engine's manager for `mode`: `kv` itself when paged, a contiguous manager over its pool otherwise."""
    if mode not in KV_ALLOCATIONS:
        raise ValueError(f"kv_allocation must be one of {KV_ALLOCATIONS}, got {mode!r}")
    if mode == "paged":
        return kv
    if type(kv) is not KVCacheManager or kv.sliding_window is not None:
        raise ValueError("kv_allocation='contiguous' supports models with one full-attention KV cache group only")
    return ContiguousKVCacheManager(kv.pool, kv.block_size, max_model_len)
