"""The KV block map: the coordinator's pools and tables as one JSON-able picture. Pure Python.

Why: paging is the seed's central idea (logical blocks mapped onto scattered physical ones,
shared where prefixes match, reclaimed in LRU order), and the numbers alone (/metrics, the
ledger) do not show it. `kvforge serve`'s `/kv` page and `kvforge top` draw this snapshot.

It is read from the state the coordinator already keeps, with no bookkeeping added to the
hot path: one pass over each pool's blocks (O(num_blocks)) plus the tables of the requests
asked for. The engine thread builds it between two steps (`AsyncEngine.call`), so it is
consistent and the loop stops only for that pass (about a microsecond a block).

Block states, one character per usable block of a group:

| char | state |
|---|---|
| `.` | free, never holding a cached prefix |
| `c` | cached and reusable: free, but its hash is indexed (a prefix hit revives it); LRU order in `lru` |
| `u` | in use by one table |
| `s` | shared: held by several tables (prefix hits, n > 1 forks); the count is in `refs` |
| `w` | written by the last step (in use; the step's chunks wrote K/V into it) |
| `r` | reserved: held by a table, but no token written in it yet (a contiguous reservation's sea of them) |

Each group also owns one null block (id `num_blocks`), drawn apart: it stands in a table where a
block was given back (out of a sliding window, or dropped by eviction) and holds nothing.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvforge.kv.blocks import BlockPool
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.kv.utilization import measure_running

FREE, CACHED, IN_USE, SHARED, WRITTEN, RESERVED = ".", "c", "u", "s", "w", "r"
STATE_NAMES = {FREE: "free", CACHED: "cached", IN_USE: "in_use", SHARED: "shared", WRITTEN: "written",
               RESERVED: "reserved"}
NULL_ID = -1  # a table slot holding the null block, as the snapshot writes it


class MapRequest(Protocol):
    """What the map reads of a request (the engine's `Request` has all of it)."""

    request_id: str
    num_computed_tokens: int
    num_cached_prompt_tokens: int
    num_evicted_tokens: int

    @property
    def num_tokens(self) -> int: ...
    @property
    def group_id(self) -> str: ...


@dataclass
class StepWrites:
    """Per group, the block ids the last step's chunks wrote into (the `w` state)."""

    blocks: list[set[int]] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: Iterable[tuple[int, int, Sequence[Sequence[int]]]], block_size: int,
                    num_groups: int, null_ids: Sequence[int], evicted: Mapping[int, int] | None = None,
                    cut_groups: Sequence[bool] | None = None) -> "StepWrites":
        """`chunks`: (start token, tokens, block ids per group) of each scheduled chunk.

        `evicted[i]`: tokens chunk i's request had compacted away by eviction (table coordinates shift
        in the groups eviction cuts, `cut_groups[g]`; None: every group).
        """
        out = cls([set() for _ in range(num_groups)])
        for i, (start, n, tables) in enumerate(chunks):
            if n <= 0:
                continue
            for g, table in enumerate(tables[:num_groups]):
                shift = (evicted or {}).get(i, 0) if cut_groups is None or cut_groups[g] else 0
                first, last = (start - shift) // block_size, (start - shift + n - 1) // block_size
                for idx in range(max(0, first), min(last + 1, len(table))):
                    if table[idx] != null_ids[g]:
                        out.blocks[g].add(table[idx])
        return out


def pool_states(pool: BlockPool, written: set[int] | None = None,
                filled: set[int] | None = None) -> tuple[str, dict[int, int], list[int]]:
    """(one state char per block, ref counts above 1, cached free blocks in eviction order).

    `filled`: the held blocks some table has written a token into (None: all of them)."""
    written = written or set()
    chars = []
    refs: dict[int, int] = {}
    for block in pool.blocks:
        if block.ref_cnt == 0:
            chars.append(FREE if block.block_hash is None else CACHED)
            continue
        if block.ref_cnt > 1:
            refs[block.block_id] = block.ref_cnt
        if block.block_id in written:
            chars.append(WRITTEN)
        elif filled is not None and block.block_id not in filled:
            chars.append(RESERVED)
        else:
            chars.append(SHARED if block.ref_cnt > 1 else IN_USE)
    lru = [bid for bid, block in pool.free_queue.items() if block.block_hash is not None]
    return "".join(chars), refs, lru


def state_counts(states: str) -> dict[str, int]:
    """How many blocks are in each state, by state name."""
    return {name: states.count(ch) for ch, name in STATE_NAMES.items()}


def build_snapshot(kv: KVCacheCoordinator, running: Sequence[MapRequest], waiting: Sequence[MapRequest],
                   writes: StepWrites | None = None, max_model_len: int | None = None,
                   step: int = 0, tiers: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """The whole map: every group's pool, each request's tables, and the gauges drawn over time.

    `max_model_len` prices what a contiguous reservation (one region of max_model_len slots per
    running sequence) would have held unused, next to what the paged pool holds unused.
    """
    groups = []
    for g, (manager, spec) in enumerate(zip(kv.managers, kv.groups)):
        pool = manager.pool
        filled = _filled_blocks(manager.tables, running, kv.block_size, manager.evicts)
        states, refs, lru = pool_states(pool, writes.blocks[g] if writes and g < len(writes.blocks) else None, filled)
        groups.append({
            "index": g, "window": manager.sliding_window, "layers": len(spec.layers),
            "num_blocks": pool.num_blocks, "null_block": pool.null_block.block_id,
            "states": states, "refs": {str(k): v for k, v in refs.items()}, "lru": lru,
            "counts": state_counts(states), "evictions": pool.num_evictions,
        })
    requests = [_request_entry(kv, r, "running") for r in running]
    requests += [_request_entry(kv, r, "waiting") for r in waiting]
    stats, use = kv.stats, measure_running(kv, running)
    # a contiguous reservation holds max_model_len slots per running sequence in every group
    contiguous = max_model_len * len(running) * kv.num_groups if max_model_len else None
    return {
        "step": step, "block_size": kv.block_size, "num_groups": kv.num_groups, "groups": groups,
        "requests": requests,
        "gauges": {
            "usage": kv.pool.usage,
            "hit_rate": stats.hit_rate,
            "prefix_queries": stats.queries, "prefix_hits": stats.hits,
            "cow_copies": kv.num_cow_copies,
            "tokens_stored": use.tokens_stored, "slots_allocated": use.slots_allocated,
            "utilization": use.utilization,
            "paged_waste": 1.0 - use.utilization if use.slots_allocated else 0.0,
            "contiguous_slots": contiguous,
            "contiguous_waste": 1.0 - use.tokens_stored / contiguous if contiguous else None,
        },
        "tiers": _tiers(tiers or {}),
    }


def _filled_blocks(tables: Mapping[str, Sequence[Any]], running: Sequence[MapRequest], block_size: int,
                   evicts: bool = True) -> set[int]:
    """Block ids that hold at least one written token of a running request (table index i holds
    positions [i * block_size, (i + 1) * block_size) of the tokens its table keeps; `evicts`: KV
    eviction cuts this group, so its tables hold the computed tokens minus the evicted ones)."""
    out: set[int] = set()
    for req in running:
        table = tables.get(req.request_id, ())
        n = -(-(req.num_computed_tokens - (req.num_evicted_tokens if evicts else 0)) // block_size)
        out.update(b.block_id for b in table[:n])
    return out


def _request_entry(kv: KVCacheCoordinator, req: MapRequest, status: str) -> dict[str, Any]:
    tables = []
    for manager in kv.managers:
        null = manager.pool.null_block
        tables.append([NULL_ID if b is null else b.block_id for b in manager.tables.get(req.request_id, ())])
    return {"id": req.request_id, "group": req.group_id, "status": status, "num_tokens": req.num_tokens,
            "num_computed": req.num_computed_tokens, "cached_prompt_tokens": req.num_cached_prompt_tokens,
            "tables": tables}


def _tiers(stats: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    """Host and disk tier occupancy beside the pool (bytes used of capacity) and their traffic so far."""
    return [{"name": name, "used_bytes": int(s.get("used_bytes", 0)), "capacity_bytes": int(s.get("capacity_bytes", 0)),
             "blocks_stored": int(s.get("blocks_stored", 0)), "blocks_loaded": int(s.get("blocks_loaded", 0)),
             "hit_rate": float(s.get("hit_rate", 0.0))} for name, s in stats.items()]
