"""One KV cache group's block tables over its own pool. Pure Python.

A group is a set of layers that share an attention window (None = full
attention), hence one block table per request. The coordinator
(`kv/coordinator.py`) owns one of these per group and is the only caller; the
request's block hashes are passed in, never stored here, so groups cannot
disagree about them.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from typing import TYPE_CHECKING

from kvforge.kv.blocks import BlockPool, KVBlock
from kvforge.kv.eviction import group_evicts
from kvforge.kv.hashing import BlockHash
from kvforge.kv.interface import KVLoad, KVRequest
from kvforge.kv.tiers.tiers import TierHit

if TYPE_CHECKING:
    from kvforge.kv.tiers.tiers import KVTiers


class GroupManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer of the group is windowed (a Mistral, a local group)
        self.tables: dict[str, list[KVBlock]] = {}
        self.num_published: dict[str, int] = {}
        self.num_cow_copies = 0  # blocks copied because a forked sample wrote into a shared partial block
        self.tiers: KVTiers | None = None  # KV tiers below this pool (set by the coordinator)
        self.loads: list[KVLoad] = []  # tier hits taken by commit_slots, for the next SchedulerOutput
        # Blocks published while a step is being scheduled, whose K/V that step has yet to write (None: no
        # step open). Nothing hits them until the step ran, so no block another table holds is ever written.
        self.filling: set[int] | None = None

    @property
    def evicts(self) -> bool:
        """Whether KV eviction cuts this group's tables (full attention; `kv/eviction.py`)."""
        return group_evicts(self.sliding_window)

    def cached_tokens(self, req: KVRequest) -> int:
        """Tokens whose K/V the request's table holds: computed minus those KV eviction compacted away
        (a windowed group is never cut: its table keeps true positions)."""
        return req.num_computed_tokens - (req.num_evicted_tokens if self.evicts else 0)

    @property
    def null_block(self) -> KVBlock:
        return self.pool.null_block

    def live(self, blocks: Iterable[KVBlock]) -> list[KVBlock]:
        """`blocks` without null-block placeholders: what really holds a reference."""
        null = self.pool.null_block
        return [b for b in blocks if b is not null]

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    @property
    def capacity_tokens(self) -> int:
        """Tokens one allocation can ever hold at once (no window freeing mid-allocation)."""
        return self.pool.num_blocks * self.block_size

    def max_request_tokens(self, max_num_batched_tokens: int) -> int | None:
        """Longest request a lone request can grow to, or None when window freeing bounds its blocks.

        A windowed table holds the window, one chunk and two partly dead or partly written blocks.
        """
        window = self.sliding_window
        if window is not None and self.capacity_tokens >= window + max_num_batched_tokens + 2 * self.block_size:
            return None
        return self.capacity_tokens

    def cached_blocks(
        self, req: KVRequest, hashes: Sequence[BlockHash], num_blocks: int, stop_at_miss: bool = False
    ) -> list[KVBlock | None]:
        """This pool's cached block (or None) for each of `req`'s first `num_blocks` full blocks."""
        bs, out = self.block_size, []
        for i, h in enumerate(hashes[:num_blocks]):
            block = self.hittable_block(h, req.all_token_ids[i * bs : (i + 1) * bs])
            if block is None and stop_at_miss:
                break
            out.append(block)
        return out

    def hittable_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for `block_hash`, unless the step being scheduled has yet to write its K/V."""
        block = self.pool.get_cached_block(block_hash, token_ids)
        return None if self._being_written(block) else block

    def is_filling(self, req: KVRequest, hashes: Sequence[BlockHash], index: int) -> bool:
        """Whether `req`'s block `index` is cached in a block the step being scheduled has yet to write."""
        if index >= len(hashes):
            return False
        bs = self.block_size
        return self._being_written(self.pool.get_cached_block(hashes[index], req.all_token_ids[index * bs : (index + 1) * bs]))

    def _being_written(self, block: KVBlock | None) -> bool:
        return block is not None and self.filling is not None and block.block_id in self.filling

    def begin_step(self) -> None:
        """Open a step: blocks published from now on are not hittable until `finish_step`."""
        self.discard_unwritten()
        self.filling = set()

    def finish_step(self) -> None:
        """The step ran: the blocks it published hold their K/V and may be hit."""
        self.filling = None

    def discard_unwritten(self) -> None:
        """The open step never ran (it raised): the blocks it published hold no valid K/V, so they lose their hash."""
        for block_id in self.filling or ():
            self.pool.uncache_block(self.pool.blocks[block_id])
        self.filling = None

    def first_live_block(self, num_blocks: int) -> int:
        """First block a windowed group keeps once `num_blocks` blocks are computed (the freeing rule)."""
        assert self.sliding_window is not None
        return max(0, num_blocks * self.block_size - self.sliding_window) // self.block_size

    def blocks_needed(self, req: KVRequest, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        held = len(self.tables.get(req.request_id, ())) + num_computed_blocks
        total = self.cached_tokens(req) + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - held)

    def can_allocate(self, req: KVRequest, num_new_tokens: int, computed_blocks: list[KVBlock]) -> bool:
        """Whether `commit_slots` would find enough free blocks; changes nothing."""
        table = self.tables.get(req.request_id, [])
        num_new_blocks = self.blocks_needed(req, num_new_tokens, len(computed_blocks))
        cow = self._needs_copy_on_write(req, table, num_new_tokens)
        # Hit blocks sitting in the free queue stop being free once touched (null placeholders are not blocks);
        # a tier hit needs a fresh block to load into.
        reclaimed = sum(1 for b in self.live(computed_blocks) if isinstance(b, TierHit) or b.ref_cnt == 0)
        return num_new_blocks + int(cow) <= self.pool.num_free_blocks - reclaimed

    def commit_slots(
        self, req: KVRequest, num_new_tokens: int, computed_blocks: list[KVBlock], hashes: Sequence[BlockHash]
    ) -> list[tuple[int, int]]:
        """Take the hit blocks and new blocks `can_allocate` just approved; returns the copy-on-write copies."""
        table = self.tables.setdefault(req.request_id, [])
        num_new_blocks = self.blocks_needed(req, num_new_tokens, len(computed_blocks))
        cow = self._needs_copy_on_write(req, table, num_new_tokens)
        self.pool.touch(b for b in self.live(computed_blocks) if isinstance(b, KVBlock))
        computed_blocks = self._load_tier_hits(computed_blocks)
        table.extend(computed_blocks)
        copies: list[tuple[int, int]] = []
        if cow:
            idx = self.cached_tokens(req) // self.block_size
            old = table[idx]
            (new,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([old])
            table[idx] = new
            copies.append((old.block_id, new.block_id))
            self.num_cow_copies += 1
        table.extend(self.pool.get_new_blocks(num_new_blocks))
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        self.num_published.setdefault(req.request_id, len(computed_blocks))
        self._publish_full_blocks(req, (num_computed + num_new_tokens) // self.block_size, hashes)
        return copies

    def _load_tier_hits(self, hits: Sequence[KVBlock | TierHit]) -> list[KVBlock]:
        """Device blocks for `hits`: a tier hit gets a fresh block, published under its hash, load queued.

        Called after the device hits are touched, so taking a fresh block cannot evict one of them.
        """
        out = []
        for hit in hits:
            if isinstance(hit, TierHit):
                assert self.tiers is not None
                (block,) = self.pool.get_new_blocks(1)
                self.loads.append(self.tiers.acquire(hit, block.block_id))
                self.pool.cache_block(block, hit.block_hash, hit.token_ids)
                hit = block
            out.append(hit)
        return out

    def release_out_of_window(self, req: KVRequest) -> None:
        """Return blocks wholly before every future query's window to the pool, keeping their table slots.

        The next query is at position num_computed_tokens and sees positions > q - window, so blocks
        ending before num_computed_tokens - window are dead. Freed blocks keep their hash (prefix
        hits stay possible; a hit always starts from the chain head, never from a placeholder), and only
        published blocks are freed so publishing never meets a placeholder (unless KV eviction cut the
        request: it publishes nothing more, so every dead block goes). A long request thus holds
        O(window / block_size) blocks. A no-op for a full-attention group.
        """
        table = self.tables.get(req.request_id)
        if not table or self.sliding_window is None:
            return
        n = max(0, req.num_computed_tokens - self.sliding_window) // self.block_size
        if self.pool.enable_caching and not req.num_evicted_tokens:  # an evicting sequence publishes no more
            n = min(n, self.num_published.get(req.request_id, 0))
        i = min(n, len(table))
        while i > 0 and table[i - 1] is not self.null_block:  # freed blocks form a prefix: scan back to it
            i -= 1
        self._replace_with_null(table, range(i, min(n, len(table))))

    def evict_blocks(self, req: KVRequest, keep: Sequence[int]) -> list[int]:
        """KV eviction: keep only the full blocks at `keep` (ascending) plus the tail; the table closes up.

        Only this request's references go: a block another table shares (prefix hit, fork) stays as it
        is, and a cached block keeps its hash, hittable until the pool reuses it. Cache coordinates then
        shift down by the evicted tokens (the request's `num_evicted_tokens`, which the caller advances);
        no null block is left, so attention needs no mask. Returns the evicted blocks' ids, in table order.
        """
        table = self.tables.get(req.request_id, [])
        num_full = self.cached_tokens(req) // self.block_size
        kept = set(keep)
        assert kept <= set(range(num_full)), "only full blocks can be evicted"
        evicted = [b for i, b in enumerate(table[:num_full]) if i not in kept]
        if evicted:
            self.tables[req.request_id] = [b for i, b in enumerate(table) if i >= num_full or i in kept]
            self.pool.free_blocks(reversed(self.live(evicted)))  # a chain's tail first, as `free` does
        return [b.block_id for b in evicted]

    def _replace_with_null(self, table: list[KVBlock], indices: Iterable[int]) -> int:
        dead = []
        for i in indices:
            if table[i] is not self.null_block:
                dead.append(table[i])
                table[i] = self.null_block
        self.pool.free_blocks(dead)
        return len(dead)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks `request_id` really holds (null placeholders excluded)."""
        return len(self.live(self.tables.get(request_id, ())))

    def _needs_copy_on_write(self, req: KVRequest, table: list[KVBlock], num_new_tokens: int) -> bool:
        """True when this step writes into a partly filled block that another table shares."""
        if num_new_tokens == 0 or self.cached_tokens(req) % self.block_size == 0:
            return False
        idx = self.cached_tokens(req) // self.block_size
        return idx < len(table) and table[idx].ref_cnt > 1

    def _publish_full_blocks(self, req: KVRequest, num_full: int, hashes: Sequence[BlockHash]) -> None:
        if not self.pool.enable_caching:
            return
        done = self.num_published.get(req.request_id, 0)
        if num_full <= done or req.num_evicted_tokens:  # an evicting sequence's blocks are not the prompt's
            return
        table, bs = self.tables[req.request_id], self.block_size
        for i in range(done, min(num_full, len(hashes))):
            if self.pool.cache_block(table[i], hashes[i], req.all_token_ids[i * bs : (i + 1) * bs]):
                if self.filling is not None:
                    self.filling.add(table[i].block_id)
        self.num_published[req.request_id] = min(num_full, len(hashes))

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """`child` shares every block of `parent` (ref counts rise); writes copy on demand."""
        table = self.tables.get(parent.request_id, [])
        self.pool.touch(self.live(table))
        self.tables[child.request_id] = list(table)
        self.num_published[child.request_id] = self.num_published.get(parent.request_id, 0)

    def free(self, req: KVRequest) -> None:
        """Release `req`'s blocks tail-first, so a chain's tail is evicted before its head."""
        table = self.tables.pop(req.request_id, [])
        self.pool.free_blocks(self.live(reversed(table)))
        self.num_published.pop(req.request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.tables.values())

