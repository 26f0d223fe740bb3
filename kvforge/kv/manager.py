"""KVCacheManager: the per-request view of the block pool.

Owns each request's block table and block hashes; answers the scheduler's two
questions, "how much of this prompt is already cached?" and "can this request
get room for N more tokens?", and publishes newly full blocks to the prefix
index. Pure Python.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvforge.engine.request import Request
from kvforge.kv.blocks import BlockPool, KVBlock
from kvforge.kv.hashing import BlockHash, extend_block_hashes


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


# Stands in a table for a block returned to the pool because it fell out of every layer's sliding
# window: logical indices keep working, its id (0) is only ever read under the window mask.
WINDOW_FREED = KVBlock(0)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer this table serves is windowed (a Mistral, a local group)
        self.tables: dict[str, list[KVBlock]] = {}
        self.hashes: dict[str, list[BlockHash]] = {}
        self.num_published: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.num_cow_copies = 0  # blocks copied because a forked sample wrote into a shared partial block
        # KV eviction's scores need some queries recomputed (kv_eviction.py): the last tokens a hit leaves
        # to compute (SnapKV's observation window; 1 = the last token, whose logits are needed) and which
        # cached blocks may be hit at all (H2O: those whose prompt scores were recorded).
        self.min_recompute_tokens = 1
        self.hit_filter: Callable[[KVBlock], bool] | None = None

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def group_block_tables(self, request_id: str) -> list[list[int]]:
        """One block table per KV cache group: here the one table every layer reads."""
        return [self.block_table(request_id)]

    def copies_by_group(self, copies: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """The copy-on-write copies `allocate_slots` returned, per KV cache group (here one)."""
        return [copies]

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

    def _block_hashes(self, req: Request) -> list[BlockHash]:
        hashes = self.hashes.setdefault(req.request_id, [])
        extra = (req.cache_salt,) if req.cache_salt else ()
        return extend_block_hashes(hashes, req.all_token_ids, self.block_size, extra)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the head of `req`; the last token is always recomputed.

        Read-only: a request that then fails to get blocks is looked up again next step, so the
        scheduler records the lookup (`record_lookup`) only once the request is admitted.
        """
        if not self.enable_caching:
            return [], 0
        hits: list[KVBlock] = []
        limit = max(0, (req.num_tokens - self.min_recompute_tokens) // self.block_size)
        for block in self.cached_blocks(req, limit, stop_at_miss=True):
            assert block is not None
            if self.hit_filter is not None and not self.hit_filter(block):
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cached_blocks(self, req: Request, num_blocks: int, stop_at_miss: bool = False) -> list[KVBlock | None]:
        """This pool's cached block (or None) for each of `req`'s first `num_blocks` full blocks."""
        bs, out = self.block_size, []
        for i, h in enumerate(self._block_hashes(req)[:num_blocks]):
            block = self.pool.get_cached_block(h, req.all_token_ids[i * bs : (i + 1) * bs])
            if block is None and stop_at_miss:
                break
            out.append(block)
        return out

    def record_lookup(self, req: Request, num_cached: int) -> None:
        """Count an admitted request's lookup; called once per admission, never for a failed attempt."""
        if self.enable_caching:
            self.stats.record(req.num_tokens, num_cached, recompute=req.num_preemptions > 0)

    def blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        held = len(self.tables.get(req.request_id, ())) + num_computed_blocks
        total = req.num_cached_kv_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - held)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[tuple[int, int]] | None:
        """Give `req` room for `num_new_tokens` more tokens, or None (nothing changed) if blocks run out.

        Returns block copies (src, dst) that copy-on-write requires before this step's writes.
        """
        computed_blocks = computed_blocks or []
        self.release_out_of_window(req)  # dead whatever happens next: no future query sees them
        if not self.can_allocate(req, num_new_tokens, computed_blocks):
            return None
        return self.commit_slots(req, num_new_tokens, computed_blocks)

    def can_allocate(self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock]) -> bool:
        """Whether `commit_slots` would find enough free blocks; changes nothing."""
        table = self.tables.get(req.request_id, [])
        num_new_blocks = self.blocks_needed(req, num_new_tokens, len(computed_blocks))
        cow = self._needs_copy_on_write(req, table, num_new_tokens)
        # Hit blocks sitting in the free queue stop being free once touched (window placeholders are not blocks).
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0 and b is not WINDOW_FREED)
        return num_new_blocks + int(cow) <= self.pool.num_free_blocks - reclaimed

    def commit_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock]) -> list[tuple[int, int]]:
        """Take the hit blocks and new blocks `can_allocate` just approved; returns the copy-on-write copies."""
        table = self.tables.setdefault(req.request_id, [])
        num_new_blocks = self.blocks_needed(req, num_new_tokens, len(computed_blocks))
        cow = self._needs_copy_on_write(req, table, num_new_tokens)
        self.pool.touch(b for b in computed_blocks if b is not WINDOW_FREED)
        table.extend(computed_blocks)
        copies: list[tuple[int, int]] = []
        if cow:
            idx = req.num_cached_kv_tokens // self.block_size
            old = table[idx]
            (new,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([old])
            table[idx] = new
            copies.append((old.block_id, new.block_id))
            self.num_cow_copies += 1
        table.extend(self.pool.get_new_blocks(num_new_blocks))
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        self.num_published.setdefault(req.request_id, len(computed_blocks))
        self._publish_full_blocks(req, (num_computed + num_new_tokens) // self.block_size)
        return copies

    def evict(self, req: Request, keep: list[int]) -> int:
        """Drop `req`'s full blocks whose table index is not in `keep` (ascending); returns how many.

        Only this request's reference goes: a block another table shares (prefix hit, fork) stays as it
        is, and a cached block keeps its hash, hittable until the pool reuses it. The table closes up
        over the gap, so cache coordinates shift down by the evicted tokens (`req.num_evicted_tokens`);
        the partly written tail block always stays. A request that evicted publishes nothing more to the
        prefix cache: its later blocks were computed against a cut context, not the full prefix.
        """
        table = self.tables.get(req.request_id, [])
        num_full = req.num_cached_kv_tokens // self.block_size
        kept = set(keep)
        assert kept <= set(range(num_full)), "only full blocks can be evicted"
        dropped = [b for i, b in enumerate(table[:num_full]) if i not in kept]
        if not dropped:
            return 0
        self.tables[req.request_id] = [b for i, b in enumerate(table) if i >= num_full or i in kept]
        self.pool.free_blocks(reversed(dropped))  # a chain's tail first, as `free` does
        n = len(dropped) * self.block_size
        req.num_evicted_tokens += n
        req.evicted_tokens_total += n
        req.evicted_blocks_total += len(dropped)
        return len(dropped)

    def release_out_of_window(self, req: Request) -> None:
        """Free `req`'s blocks that no future query can see (windowed tables only; a no-op otherwise).

        The scheduler calls this for every running request before a step's allocations, so a request
        the step's token budget leaves out holds no more than its window either.
        """
        table = self.tables.get(req.request_id)
        if table:
            self._free_blocks_outside_window(req, table)

    def _free_blocks_outside_window(self, req: Request, table: list[KVBlock]) -> None:
        """Return blocks wholly before every future query's window to the pool, keeping their table slots.

        The next query is at position num_computed_tokens and sees positions > q - window, so blocks
        ending before num_computed_tokens - window are dead. Freed blocks keep their hash (prefix
        hits stay possible; a hit always starts from the chain head, never from a placeholder), and only
        published blocks are freed so publishing never meets a placeholder. A long request thus holds
        O(window / block_size) blocks.
        """
        if self.sliding_window is None:
            return
        n = max(0, req.num_computed_tokens - self.sliding_window) // self.block_size
        if self.enable_caching:
            n = min(n, self.num_published.get(req.request_id, 0))
        i = min(n, len(table))
        while i > 0 and table[i - 1] is not WINDOW_FREED:  # freed blocks form a prefix: scan back to it
            i -= 1
        dead = table[i:n]
        if dead:
            table[i:n] = [WINDOW_FREED] * len(dead)
            self.pool.free_blocks(dead)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks `request_id` really holds (window-freed slots excluded)."""
        return sum(1 for b in self.tables.get(request_id, ()) if b is not WINDOW_FREED)

    def _needs_copy_on_write(self, req: Request, table: list[KVBlock], num_new_tokens: int) -> bool:
        """True when this step writes into a partly filled block that another table shares."""
        if num_new_tokens == 0 or req.num_cached_kv_tokens % self.block_size == 0:
            return False
        idx = req.num_cached_kv_tokens // self.block_size
        return idx < len(table) and table[idx].ref_cnt > 1

    def _publish_full_blocks(self, req: Request, num_full: int) -> None:
        if not self.enable_caching:
            return
        done = self.num_published.get(req.request_id, 0)
        if num_full <= done or req.num_evicted_tokens:
            return
        hashes = self._block_hashes(req)
        table, bs = self.tables[req.request_id], self.block_size
        for i in range(done, min(num_full, len(hashes))):
            self.pool.cache_block(table[i], hashes[i], req.all_token_ids[i * bs : (i + 1) * bs])
        self.num_published[req.request_id] = min(num_full, len(hashes))

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (ref counts rise); writes copy on demand."""
        table = self.tables.get(parent.request_id, [])
        self.pool.touch(b for b in table if b is not WINDOW_FREED)
        self.tables[child.request_id] = list(table)
        self.hashes[child.request_id] = list(self.hashes.get(parent.request_id, []))
        self.num_published[child.request_id] = self.num_published.get(parent.request_id, 0)

    def free(self, req: Request) -> None:
        """Release `req`'s blocks tail-first, so a chain's tail is evicted before its head."""
        table = self.tables.pop(req.request_id, [])
        self.pool.free_blocks(b for b in reversed(table) if b is not WINDOW_FREED)
        self.hashes.pop(req.request_id, None)
        self.num_published.pop(req.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity([b for b in t if b is not WINDOW_FREED] for t in self.tables.values())
