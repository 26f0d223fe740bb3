"""The KV cache contract: what the scheduler, the model runner and the next KV features rely on.

Pure Python and imports nothing above `kv/`: the request is seen through the
`KVRequest` Protocol (the engine's `Request` satisfies it structurally), so the
KV layer never imports the engine.

Shapes, always per KV cache group (a plain model has exactly one group):

- `KVCacheBlocks`: one list of blocks per group (prefix hits, a request's tables).
- `BlockCopies`: one list of (src, dst) block ids per group (copy-on-write before a step's writes).
- block ids: one list of ints per group (what the runner turns into block tables).

`KVCacheCoordinatorProtocol` is the public contract. Two features build on it
(docs/DESIGN.md, "KV coordinator contract"):

- KV eviction (removing KV from the middle of a sequence, `kv_eviction=...`,
  engine/kv_eviction.py): `evict_blocks` keeps chosen full blocks in the
  full-attention group (a windowed group is never cut), the table closes up,
  the request's `num_evicted_tokens` shifts that group's cache coordinates,
  and attention reads a shorter table with no mask, in every backend.
- KV tiers use `BlockPool.add_evict_listener` (a hook when a cached block leaves
  the device pool) and a `SecondaryKVCache`: a prefix lookup continues into it
  after the device misses, and the allocation that admits the request yields
  `KVLoad`s (second-level key -> freshly allocated device block). The other
  direction is a `KVExport` (a device block whose bytes go down to the tiers
  before its new owner writes it: an evicted cached block, or a swap-out at
  preemption). Both travel to the runner in `SchedulerOutput` (`block_exports`,
  `block_loads`), like copies: the runner never reads a queue the coordinator fills.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvforge.kv.hashing import BlockHash

if TYPE_CHECKING:
    from kvforge.kv.blocks import BlockPool, KVBlock
    from kvforge.kv.stats import PrefixCacheStats

BlockCopies = list[list[tuple[int, int]]]  # per group: (src block id, dst block id)


class KVRequest(Protocol):
    """What the KV layer reads and writes of a request.

    `block_hashes` belongs to the request: the coordinator appends a block's hash
    once it fills and never recomputes it (a preempted request keeps its chain);
    every group reads the same list. `cached_tokens_by_tier` and
    `admitted_tokens_by_tier` are the fields the coordinator sets: the tokens each
    level (device, host, disk) served at first admission, which the request's
    output reports, and at the latest admission, a re-admission after preemption
    included, which the KV map's `admit` event shows.
    """

    cached_tokens_by_tier: dict[str, int]
    admitted_tokens_by_tier: dict[str, int]

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def block_hashes(self) -> list[BlockHash]: ...
    @property
    def num_evicted_tokens(self) -> int:
        """KV eviction: tokens evicted from the middle of the sequence (the full-attention group's cache
        length = computed - evicted; windowed groups keep true positions)."""
        ...


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV cache group: `blocks[g]` is group g's list (prefix hits, or a request's table)."""

    blocks: tuple[list[KVBlock], ...]

    @classmethod
    def empty(cls, num_groups: int) -> KVCacheBlocks:
        return cls(tuple([] for _ in range(num_groups)))

    @property
    def num_groups(self) -> int:
        return len(self.blocks)

    def get_block_ids(self) -> list[list[int]]:
        return [[b.block_id for b in group] for group in self.blocks]


@dataclass(frozen=True)
class KVLoad:
    """Tiers: copy the block stored under `key` in a second-level cache into device block `dst` of `group`."""

    group: int
    key: BlockHash
    dst: int


@dataclass(frozen=True)
class KVExport:
    """Tiers: copy device block `block_id` (holding `token_ids`, hashed `block_hash`) down to the tiers
    before anything overwrites it; `swap`: a preempted request's block, kept in host memory only;
    `durable`: a block just cached, written through to the disk tier only (it stays on the device)."""

    block_id: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    swap: bool = False
    durable: bool = False


class SecondaryKVCache(Protocol):
    """A second-level KV store (host memory, disk) keyed by block hash; the tiers feature implements it."""

    def contains(self, key: BlockHash) -> bool: ...
    def store(self, group: int, key: BlockHash, block_id: int) -> None:
        """Copy device block `block_id` of `group` out under `key` (called from the pool's evict hook)."""
        ...


class EvictListener(Protocol):
    def __call__(self, block_hash: BlockHash, block_id: int) -> None: ...


class KVCacheCoordinatorProtocol(Protocol):
    """One KV cache coordinator for every model: a plain model is one group, a hybrid one several.

    Every result is per group. A failed `allocate_slots` changes nothing (blocks that fell out of a
    window aside: they were dead anyway). The runner never calls the coordinator: block ids and
    copies reach it through `SchedulerOutput`.
    """

    block_size: int

    @property
    def num_groups(self) -> int: ...
    @property
    def pools(self) -> Sequence[BlockPool]: ...
    stats: PrefixCacheStats
    @property
    def enable_caching(self) -> bool: ...
    @property
    def capacity_tokens(self) -> int: ...
    def max_request_tokens(self, max_num_batched_tokens: int) -> int | None: ...

    def get_computed_blocks(self, req: KVRequest) -> tuple[KVCacheBlocks, int]:
        """Per-group hit blocks of the longest cached prefix valid in every group, and its length in tokens."""
        ...

    def record_lookup(self, req: KVRequest, num_cached: int) -> None: ...
    def begin_step(self) -> None:
        """A step is being scheduled: blocks it publishes are not hittable until `finish_step`."""
        ...

    def finish_step(self) -> None:
        """The step ran: the blocks it published hold their K/V and may be hit."""
        ...

    def waits_for_fill(self, req: KVRequest, num_cached_tokens: int) -> bool:
        """Whether `req`'s prefix hit stops at a block the step being scheduled is writing."""
        ...

    def discard_unwritten(self) -> None:
        """The open step failed before it ran: the blocks it published lose their hash (no hit, no tier export)."""
        ...

    def release_out_of_window(self, req: KVRequest) -> None: ...

    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, computed: KVCacheBlocks | None = None
    ) -> BlockCopies | None:
        """Room for `num_new_tokens` more tokens in every group (copy-on-write copies per group), or None."""
        ...

    def block_ids(self, request_id: str) -> list[list[int]]: ...
    def num_held_blocks(self, request_id: str) -> list[int]: ...
    def take_block_loads(self) -> list[KVLoad]:
        """KV tiers: the loads the allocations since the last call took (empty without tiers)."""
        ...

    def take_block_exports(self) -> list[KVExport]:
        """KV tiers: the blocks evicted or swapped out since the last call, to copy down before they are
        overwritten (empty without tiers)."""
        ...

    def should_swap(self, req: KVRequest) -> bool:
        """KV tiers: swap `req`'s blocks out at preemption rather than recompute them later?"""
        ...

    def swap_out(self, req: KVRequest) -> None: ...
    def evict_blocks(self, req: KVRequest, keep: Sequence[int]) -> list[list[int]]:
        """KV eviction: keep only the full blocks at `keep` in the full-attention group, its table closing
        up (windowed groups are not cut); returns the evicted block ids per group."""
        ...

    def fork(self, parent: KVRequest, child: KVRequest) -> None: ...
    def free(self, req: KVRequest) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def check_integrity(self) -> None: ...
