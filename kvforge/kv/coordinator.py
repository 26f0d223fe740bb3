"""KVCacheCoordinator: the one KV cache manager, for plain and hybrid models alike. Pure Python.

A model's layers fall into KV cache groups by attention window
(`ledger.kv_cache_groups`): a plain model is one group, Gemma 2/3 or Qwen2 with
`max_window_layers` a full-attention group and one group per window. Each group
has its own pool and tables (`GroupManager`); a windowed group frees blocks that
left its window while the request runs, a full group never does.

What the coordinator adds is the one contract (`kv/interface.py`): every result
is per group; an allocation takes slots in every group or changes nothing; a
prefix hit is the longest one valid in every group; the request's block hashes
are computed once, on the request, and read by every group.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from kvforge.kv.blocks import BlockPool, KVBlock
from kvforge.kv.group_manager import GroupManager
from kvforge.kv.hashing import BlockHash, extend_block_hashes
from kvforge.kv.interface import BlockCopies, KVCacheBlocks, KVExport, KVLoad, KVRequest
from kvforge.kv.stats import PrefixCacheStats
from kvforge.kv.tiers.tiers import TierHit
from kvforge.ledger import KVGroup

if TYPE_CHECKING:
    from kvforge.kv.tiers.tiers import KVTiers


class PoolsView:
    """Every group's pool seen as one, for leak checks, gauges and messages.

    Block counts add up; usage weighs each pool by its layers, since every layer's block costs
    the same bytes: usage = used bytes / total bytes across groups.
    """

    def __init__(self, pools: Sequence[BlockPool], layers_per_group: Sequence[int]) -> None:
        self.pools, self.weights = list(pools), list(layers_per_group)

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def num_cached_blocks(self) -> int:
        return sum(p.num_cached_blocks for p in self.pools)

    @property
    def num_evictions(self) -> int:
        return sum(p.num_evictions for p in self.pools)

    @property
    def usage(self) -> float:
        total = sum(p.num_blocks * w for p, w in zip(self.pools, self.weights))
        used = sum((p.num_blocks - p.num_free_blocks) * w for p, w in zip(self.pools, self.weights))
        return used / total


class KVCacheCoordinator:
    """Implements `KVCacheCoordinatorProtocol` over one `GroupManager` per KV cache group.

    Group 0 anchors prefix hits: it needs every block of the hit (a full-attention group, or the
    only group of an all-windowed model); any other (windowed) group needs only the blocks its window
    still sees once the hit is computed, the earlier ones being null placeholders.
    """

    def __init__(self, groups: Sequence[KVGroup], block_size: int, enable_caching: bool = True) -> None:
        if not groups:
            raise ValueError("a KV cache coordinator needs at least one KV cache group")
        if any(g.window is None for g in groups[1:]):
            raise ValueError("only group 0 may be a full-attention group")
        self.groups = list(groups)
        self.block_size = block_size
        self.managers = [GroupManager(BlockPool(g.num_blocks, enable_caching), block_size, g.window) for g in groups]
        self.pool = PoolsView(self.pools, [len(g.layers) for g in groups])
        self.stats = PrefixCacheStats()
        self.tiers: KVTiers | None = None  # host/disk tiers below the device pool (kvforge.kv.tiers)
        self.exports: list[KVExport] = []  # blocks to copy down to the tiers, taken into the next SchedulerOutput
        # KV eviction's scores need some queries computed, never hit (engine/kv_eviction.py): given a
        # request and its cached head blocks, how many of them it may use (None: all).
        self.hit_limit: Callable[[KVRequest, list[KVBlock]], int] | None = None

    # ---- KV tiers -------------------------------------------------------------------------
    def attach_tiers(self, tiers: KVTiers) -> None:
        """Evicted cached blocks go to `tiers`; a prefix lookup that misses the device continues there.

        One full-attention group only: a windowed or hybrid model's hits need per-group placeholders
        the tiers do not model yet.
        """
        if self.num_groups != 1 or self.managers[0].sliding_window is not None:
            raise ValueError("kv_offload_memory / kv_disk_cache do not support sliding-window or hybrid KV caches yet")
        manager = self.managers[0]
        pool = manager.pool

        def on_evict(block_hash: BlockHash, block_id: int) -> None:  # called before the block forgets its tokens
            tokens = pool.blocks[block_id].token_ids
            if tokens is not None:
                self.exports.append(KVExport(block_id, block_hash, tokens))

        pool.add_evict_listener(on_evict)
        manager.tiers = self.tiers = tiers

    def take_block_loads(self) -> list[KVLoad]:
        """Tier hits the allocations since the last call took: the runner loads them before the forward pass."""
        loads: list[KVLoad] = []
        for m in self.managers:
            loads.extend(m.loads)
            m.loads.clear()
        return loads

    def take_block_exports(self) -> list[KVExport]:
        """Blocks evicted or swapped out since the last call: the runner copies them down to the tiers before
        the step's writes (the scheduler takes them after every allocation of the step)."""
        exports, self.exports = self.exports, []
        return exports

    def cached_block_exports(self) -> list[KVExport]:
        """Every cached block of the device pool as an export (shutdown: the tiers keep what the pool had)."""
        return [KVExport(b.block_id, b.block_hash, b.token_ids) for b in self.managers[0].pool.blocks
                if b.block_hash is not None and b.token_ids is not None]

    def should_swap(self, req: KVRequest) -> bool:
        """Swap `req`'s blocks to the host tier at preemption (the measured ledger's cheaper choice)?"""
        return self.tiers is not None and self.tiers.should_swap(self.managers[0].num_published.get(req.request_id, 0))

    def swap_out(self, req: KVRequest) -> None:
        """Queue `req`'s full published blocks for the host tier; re-admission loads them back as tier hits."""
        assert self.tiers is not None
        m = self.managers[0]
        table = m.tables.get(req.request_id, [])[: m.num_published.get(req.request_id, 0)]
        self.exports.extend(KVExport(b.block_id, b.block_hash, b.token_ids, swap=True) for b in table
                            if b.block_hash is not None and b.token_ids is not None)

    # ---- shape and capacity ---------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def pools(self) -> list[BlockPool]:
        return [m.pool for m in self.managers]

    @property
    def enable_caching(self) -> bool:
        return self.managers[0].pool.enable_caching

    @property
    def num_cow_copies(self) -> int:
        return sum(m.num_cow_copies for m in self.managers)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one allocation can hold at once: the smallest group's pool decides."""
        return min(m.capacity_tokens for m in self.managers)

    def max_request_tokens(self, max_num_batched_tokens: int) -> int | None:
        """Longest request a lone request can grow to; None when window freeing bounds every group."""
        limits = [n for n in (m.max_request_tokens(max_num_batched_tokens) for m in self.managers) if n is not None]
        return min(limits) if limits else None

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [m.block_ids(request_id) for m in self.managers]

    def num_held_blocks(self, request_id: str) -> list[int]:
        return [m.num_held_blocks(request_id) for m in self.managers]

    def tables(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (null placeholders included), for inspection and tests."""
        return KVCacheBlocks(tuple(list(m.tables.get(request_id, ())) for m in self.managers))

    # ---- prefix cache ---------------------------------------------------------------------
    def block_hashes(self, req: KVRequest) -> list[BlockHash]:
        """The request's hash chain, extended in place to every full block; earlier hashes are kept."""
        extra = (req.cache_salt,) if req.cache_salt else ()
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, extra)

    def get_computed_blocks(self, req: KVRequest) -> tuple[KVCacheBlocks, int]:
        """Per-group hit blocks for the longest cached prefix valid in every group, and its length in tokens.

        The last token is always recomputed (its logits are needed). Read-only: a request that then
        fails to get blocks is looked up again next step, so the scheduler records the lookup
        (`record_lookup`) only once the request is admitted.
        """
        if not self.enable_caching:
            return KVCacheBlocks.empty(self.num_groups), 0
        hashes = self.block_hashes(req)
        if self.tiers is not None:
            return self._computed_blocks_with_tiers(req, hashes)
        anchor, *others = self.managers
        head = anchor.cached_blocks(req, hashes, (req.num_tokens - 1) // self.block_size, stop_at_miss=True)
        if self.hit_limit is not None:
            head = head[: self.hit_limit(req, head)]  # type: ignore[arg-type]
        found = [m.cached_blocks(req, hashes, len(head)) for m in others]
        runs = [_runs(f) for f in found]  # runs[g][j]: cached blocks in a row ending at block j
        k = len(head)
        while k > 0 and not all(run[k - 1] >= k - m.first_live_block(k) for m, run in zip(others, runs)):
            k -= 1
        hits: list[list[KVBlock]] = [[b for b in head[:k] if b is not None]]
        for m, f in zip(others, found):
            first = m.first_live_block(k)
            hits.append([m.null_block] * first + [b for b in f[first:k] if b is not None])
        return KVCacheBlocks(tuple(hits)), k * self.block_size

    def _computed_blocks_with_tiers(self, req: KVRequest, hashes: list[BlockHash]) -> tuple[KVCacheBlocks, int]:
        """Each block from the device pool, else from the fastest tier holding it; stops at the first miss."""
        assert self.tiers is not None
        self.tiers.forget_lookup(req.request_id)
        manager, bs, hits = self.managers[0], self.block_size, []
        for i, h in enumerate(hashes[: (req.num_tokens - 1) // bs]):
            tokens = req.all_token_ids[i * bs : (i + 1) * bs]
            hit = manager.hittable_block(h, tokens) or self.tiers.lookup(req.request_id, h, tokens)
            if hit is None:
                break
            hits.append(hit)
        # tier hits ride in the device list until commit_slots gives each a fresh block
        return KVCacheBlocks((cast(list[KVBlock], hits),)), len(hits) * bs

    def begin_step(self) -> None:
        """The scheduler opens a step: until `finish_step`, blocks published by this step's allocations
        cannot be hit (their K/V is written only when the step runs), so a request admitted later in the
        same step never shares a block that is still being written (see `waits_for_fill`). Blocks
        published by a step that never reached `finish_step` (it failed) lose their hash."""
        for m in self.managers:
            m.begin_step()

    def finish_step(self) -> None:
        """The step ran: the blocks it published hold their K/V and may be hit from now on.

        With a disk tier they are also queued for it at once (write-through), so a process that
        exits without `close()` or is killed leaves them on disk (kvforge/kv/tiers/tiers.py)."""
        if self.tiers is not None and self.tiers.disk is not None:
            m = self.managers[0]  # tiers: one full-attention group (attach_tiers)
            for block_id in sorted(m.filling or ()):
                block = m.pool.blocks[block_id]
                if block.block_hash is not None and block.token_ids is not None and self.tiers.accepts_write_through():
                    self.exports.append(KVExport(block_id, block.block_hash, block.token_ids, durable=True))
        for m in self.managers:
            m.finish_step()

    def discard_unwritten(self) -> None:
        """The open step failed before it ran: the blocks it published lose their hash at once (no hit, no
        eviction counted, no tier export), since their rows hold no valid K/V."""
        for m in self.managers:
            m.discard_unwritten()

    def waits_for_fill(self, req: KVRequest, num_cached_tokens: int) -> bool:
        """Whether `req`'s prefix hit (of `num_cached_tokens`, from `get_computed_blocks`) stops at a block
        the step being scheduled is writing: admitted next step, `req` would hit it rather than compute it."""
        index = num_cached_tokens // self.block_size  # the block the hit stopped at (never the last token's)
        if not self.enable_caching or index >= (req.num_tokens - 1) // self.block_size:
            return False
        return self.managers[0].is_filling(req, req.block_hashes, index)

    def record_lookup(self, req: KVRequest, num_cached: int) -> None:
        """Count an admitted request's lookup; called once per admission, never for a failed attempt."""
        if self.enable_caching:
            self.stats.record(req.num_tokens, num_cached, recompute=req.num_preemptions > 0)
        if self.tiers is not None:
            self.tiers.record_lookup(req.request_id)

    # ---- allocation -----------------------------------------------------------------------
    def release_out_of_window(self, req: KVRequest) -> None:
        """Free blocks no future query of `req` can see, in every windowed group.

        The scheduler calls this for every running request before a step's allocations, so a request
        the step's token budget leaves out holds no more than its window either.
        """
        for m in self.managers:
            m.release_out_of_window(req)

    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, computed: KVCacheBlocks | None = None
    ) -> BlockCopies | None:
        """Room for `num_new_tokens` in every group, or None with no group changed (dead blocks aside).

        Returns the block copies (src, dst) per group that copy-on-write requires before this step's writes.
        """
        hits = computed.blocks if computed is not None else tuple([] for _ in self.managers)
        if len(hits) != self.num_groups:
            raise ValueError(f"computed blocks have {len(hits)} groups, the cache has {self.num_groups}")
        self.release_out_of_window(req)  # dead whatever happens next: no future query sees them
        if not all(m.can_allocate(req, num_new_tokens, h) for m, h in zip(self.managers, hits)):
            return None
        hashes = self.block_hashes(req) if self.enable_caching else []
        if req.num_computed_tokens == 0 and req.request_id not in self.managers[0].tables:  # an admission
            req.admitted_tokens_by_tier = self._count_by_tier(hits[0])
            if req.num_preemptions == 0:
                req.cached_tokens_by_tier = dict(req.admitted_tokens_by_tier)
        return [m.commit_slots(req, num_new_tokens, h, hashes) for m, h in zip(self.managers, hits)]

    def _count_by_tier(self, hits: Sequence[KVBlock | TierHit]) -> dict[str, int]:
        """Prompt tokens each level served at admission: the device pool, then each tier."""
        counts = {"device": 0, **{name: 0 for name in (self.tiers.names if self.tiers else ())}}
        for hit in hits:
            counts[hit.tier if isinstance(hit, TierHit) else "device"] += self.block_size
        return counts

    def evict_blocks(self, req: KVRequest, keep: Sequence[int]) -> list[list[int]]:
        """KV eviction: in the full-attention group, keep only the full blocks at `keep`; the table closes up.

        Windowed groups are left as they are (`kv/eviction.py`, `group_evicts`): their window bounds
        them already and their tables keep true positions. Returns the evicted block ids per group (as
        `block_ids` does; empty for a windowed group). Positions shift in the cut group: the caller
        advances the request's `num_evicted_tokens` by the evicted blocks x block_size, and attention
        there reads a shorter table with no mask (no null block is left in it).
        """
        if not any(m.evicts for m in self.managers):
            raise ValueError("KV eviction needs a full-attention group: every group here is windowed")
        return [m.evict_blocks(req, keep) if m.evicts else [] for m in self.managers]

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """`child` shares every block of `parent` in every group; its hash chain starts as a copy."""
        child.block_hashes[:] = parent.block_hashes
        for m in self.managers:
            m.fork(parent, child)

    def free(self, req: KVRequest) -> None:
        """Release `req`'s blocks in every group (its hash chain stays on the request for readmission)."""
        for m in self.managers:
            m.free(req)
        if self.tiers is not None:
            self.tiers.forget_lookup(req.request_id)  # an aborted waiting request leaves no lookup trace

    def reset_prefix_cache(self) -> bool:
        """All pools or none: refused while any group holds a block."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        return all([p.reset_prefix_cache() for p in self.pools])

    def check_integrity(self) -> None:
        for m in self.managers:
            m.check_integrity()
            assert m.tables.keys() == self.managers[0].tables.keys(), "a request holds tables in only some groups"


def _runs(found: list[KVBlock | None]) -> list[int]:
    out, run = [], 0
    for block in found:
        run = run + 1 if block is not None else 0
        out.append(run)
    return out
