"""BlockPool: ref-counted KV blocks, an LRU free queue, and the prefix index.

Freed blocks keep their hash and stay hittable until they are reused; the free
queue's front is evicted first. Callers free a request's blocks tail-first so a
chain's tail is evicted before its head.

Every pool also owns one reserved null block (id `num_blocks`, one row past the
usable ones): it stands in a block table where a block was given back while the
request runs (outside a sliding window, or dropped by lossy eviction), so table
indices keep meaning token positions. It is never handed out, ref-counted,
cached or freed, and its row is only ever read under an attention mask. Pure Python.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvforge.kv.hashing import BlockHash

EvictCallback = Callable[[BlockHash, int], None]  # (evicted block's hash, its block id)


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict gives O(1) append, pop-front, and removal from the middle (on a hit).
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.null_block = KVBlock(num_blocks)  # reserved: never in `blocks`, the free queue or the index
        self._evict_listeners: list[EvictCallback] = []

    @property
    def num_physical_blocks(self) -> int:
        """Rows the cache tensors need: the usable blocks plus the null block."""
        return self.num_blocks + 1

    def add_evict_listener(self, callback: EvictCallback) -> None:
        """Call `callback(hash, block_id)` when a cached block is evicted, before its row is reused.

        The hook a second-level KV tier uses to copy the block out while its data is still intact.
        """
        self._evict_listeners.append(callback)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.num_evictions += 1
                for callback in self._evict_listeners:
                    callback(block.block_hash, block.block_id)
            block.block_hash = None
            block.token_ids = None

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for `block_hash`, confirmed by its token ids (no silent collision)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in eviction order (first freed = first evicted)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Index a newly full block; the first block to publish a hash keeps it. True if `block` was indexed."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        return True

    def uncache_block(self, block: KVBlock) -> None:
        """Take `block` out of the prefix index without counting an eviction or telling the evict listeners.

        For a block published by a step that never ran: its row holds no valid KV, so nothing may hit
        it and no tier may copy it out.
        """
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        return True

    def check_integrity(self, tables: Iterable[Sequence[KVBlock]]) -> None:
        """Assert the invariants: free xor referenced, ref counts = holders, index consistent."""
        holders: dict[int, int] = {}
        for table in tables:
            for block in table:
                if block is self.null_block:
                    continue
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"{block} held by {holders.get(block.block_id, 0)}"
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), f"{block} free-queue mismatch"
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and null.block_id == self.num_blocks, "null block used"
        assert len(self.free_queue) + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
        for h, block in self.cached.items():
            assert block.block_hash == h and block.token_ids is not None, f"index entry {block} stale"
        for block in self.blocks:  # a hashed block is always the indexed one: eviction cannot miss it
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} has a hash but is not indexed"
