"""HybridKVCacheManager: one block table per KV cache group for local/global models.

Gemma 2/3 and Qwen2 with max_window_layers mix sliding-window and full-attention
layers. One table for all layers must keep every block for the global layers, so
the local layers waste memory on blocks none of their queries can see. Here each
group of layers with the same window (`ledger.kv_cache_groups`) has its own pool
and tables, managed by an ordinary `KVCacheManager`; a windowed group frees
blocks that left its window while the request runs, the full group never does.

What this class adds is the coordination: an allocation takes slots in every
group or changes nothing, a prefix hit is the longest one valid in every group,
and fork/free/reset/integrity run across groups. Pure Python.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvforge.engine.request import Request
from kvforge.kv.blocks import BlockPool, KVBlock
from kvforge.kv.manager import WINDOW_FREED, KVCacheManager, PrefixCacheStats
from kvforge.ledger import KVGroup

GroupCopy = tuple[int, int, int]  # (group, src block, dst block)


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


class HybridKVCacheManager:
    def __init__(self, groups: Sequence[KVGroup], block_size: int, enable_caching: bool = True) -> None:
        assert len(groups) > 1 and groups[0].window is None, "group 0 is the full-attention group"
        self.groups = list(groups)
        self.block_size = block_size
        self.managers = [KVCacheManager(BlockPool(g.num_blocks, enable_caching), block_size, g.window) for g in groups]
        for m in self.managers[1:]:  # one hash chain per request, computed once for every group
            m.hashes = self.managers[0].hashes
        self.pool = PoolsView([m.pool for m in self.managers], [len(g.layers) for g in groups])
        self.sliding_window = None  # no single window covers every layer
        self.stats = PrefixCacheStats()

    @property
    def enable_caching(self) -> bool:
        return self.managers[0].enable_caching

    @property
    def num_cow_copies(self) -> int:
        return sum(m.num_cow_copies for m in self.managers)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self.managers[group].block_table(request_id)

    def group_block_tables(self, request_id: str) -> list[list[int]]:
        return [m.block_table(request_id) for m in self.managers]

    def copies_by_group(self, copies: list[GroupCopy]) -> list[list[tuple[int, int]]]:
        out: list[list[tuple[int, int]]] = [[] for _ in self.managers]
        for group, src, dst in copies:
            out[group].append((src, dst))
        return out

    @property
    def capacity_tokens(self) -> int:
        return min(m.capacity_tokens for m in self.managers)

    def max_request_tokens(self, max_num_batched_tokens: int) -> int | None:
        limits = [m.max_request_tokens(max_num_batched_tokens) for m in self.managers]
        return min(n for n in limits if n is not None)  # the full group always has a limit

    def num_held_blocks(self, request_id: str) -> int:
        return sum(self.held_blocks_by_group(request_id))

    def held_blocks_by_group(self, request_id: str) -> list[int]:
        return [m.num_held_blocks(request_id) for m in self.managers]

    # ---- prefix cache ---------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[list[KVBlock]], int]:
        """Per-group hit blocks for the longest cached prefix valid in every group, and its length in tokens.

        A hit of k blocks needs the full group's blocks [0, k) and, in a windowed group, only the blocks
        the window still sees once k * block_size tokens are computed: the earlier slots are window
        placeholders, exactly as if the request had computed them and freed them itself.
        """
        empty: list[list[KVBlock]] = [[] for _ in self.managers]
        if not self.enable_caching:
            return empty, 0
        full_hits, _ = self.managers[0].get_computed_blocks(req)
        found = [m.cached_blocks(req, len(full_hits)) for m in self.managers[1:]]
        runs = [_runs(f) for f in found]  # runs[g][j]: cached blocks in a row ending at block j
        k = len(full_hits)
        while k > 0 and not all(
            run[k - 1] >= k - self._first_live(m, k) for m, run in zip(self.managers[1:], runs)
        ):
            k -= 1
        hits = [full_hits[:k]]
        for m, f in zip(self.managers[1:], found):
            first = self._first_live(m, k)
            hits.append([WINDOW_FREED] * first + [b for b in f[first:k] if b is not None])
        return hits, k * self.block_size

    def _first_live(self, m: KVCacheManager, num_blocks: int) -> int:
        """First block a windowed group keeps once `num_blocks` blocks are computed (the freeing rule)."""
        assert m.sliding_window is not None
        return max(0, num_blocks * self.block_size - m.sliding_window) // self.block_size

    def should_swap(self, req: Request) -> bool:
        """KV tiers do not serve hybrid (several KV cache group) models: preemption recomputes."""
        return False

    def record_lookup(self, req: Request, num_cached: int) -> None:
        if self.enable_caching:
            self.stats.record(req.num_tokens, num_cached, recompute=req.num_preemptions > 0)

    # ---- allocation -----------------------------------------------------------------------
    def release_out_of_window(self, req: Request) -> None:
        for m in self.managers:
            m.release_out_of_window(req)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[list[KVBlock]] | None = None
    ) -> list[GroupCopy] | None:
        """Room for `num_new_tokens` in every group, or None with no group changed (dead blocks aside)."""
        computed = computed_blocks or [[] for _ in self.managers]
        self.release_out_of_window(req)
        if not all(m.can_allocate(req, num_new_tokens, c) for m, c in zip(self.managers, computed)):
            return None
        return [
            (g, src, dst)
            for g, (m, c) in enumerate(zip(self.managers, computed))
            for src, dst in m.commit_slots(req, num_new_tokens, c)
        ]

    def fork(self, parent: Request, child: Request) -> None:
        for m in self.managers:
            m.fork(parent, child)

    def free(self, req: Request) -> None:
        for m in self.managers:
            m.free(req)

    def reset_prefix_cache(self) -> bool:
        """All pools or none: refused while any group holds a block."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        return all([m.reset_prefix_cache() for m in self.managers])

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


def make_kv_manager(
    groups: Sequence[KVGroup], block_size: int, enable_caching: bool = True
) -> KVCacheManager | HybridKVCacheManager:
    """One group: the single-table manager of old (window freeing if every layer is windowed); else hybrid."""
    if len(groups) == 1:
        return KVCacheManager(BlockPool(groups[0].num_blocks, enable_caching), block_size, groups[0].window)
    return HybridKVCacheManager(groups, block_size, enable_caching)
