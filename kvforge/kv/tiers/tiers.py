"""KVTiers: the host and disk tiers behind one object the KV coordinator and the model runner share.

The coordinator (pure Python) talks to it in block terms: `lookup` continues a
prefix lookup that missed the device, `acquire` turns a hit into a `KVLoad` into
a fresh device block. What goes down to the tiers (a block the pool evicted, a
preempted request's blocks) the coordinator records as `KVExport`s. Both travel
to the runner in `SchedulerOutput` (`block_exports`, `block_loads`), and the
runner calls `sync(mover, exports, loads)` before each forward pass: the exports
run first (an evicted block's bytes are read before its new owner overwrites
them), then the loads. Tiers
are inclusive: an evicted block goes to every tier; hits are served by the
fastest tier that has it. No torch here: bytes move through the `BlockMover`.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvforge.kv.interface import KVExport, KVLoad
from kvforge.kv.tiers.cost import SwapCost
from kvforge.kv.tiers.keys import tier_key
from kvforge.kv.tiers.stats import TierStats


@dataclass
class TierHit:
    """A block found in a tier; a disk hit carries its verified payload, a host hit its slot."""

    tier: str
    key: bytes
    block_hash: bytes
    token_ids: tuple[int, ...]
    slot: int | None = None
    payload: bytes | None = None


class KVTiers:
    def __init__(self, namespace: bytes, block_size: int, host: Any = None, disk: Any = None,
                 preemption_mode: str = "auto") -> None:
        if host is None and disk is None:
            raise ValueError("KVTiers needs a host tier, a disk tier or both")
        self.namespace, self.block_size = namespace, block_size
        self.host, self.disk = host, disk
        self.preemption_mode = preemption_mode
        self.swap_cost: SwapCost | None = None  # set once the engine has measured its rates
        self.copy_bytes_per_s: float | None = None  # measured device <-> host round trip
        self.disk_bytes_per_s: float | None = None  # measured read + verify of a probe file
        self.stats = {t.name: TierStats(t.name) for t in self.tiers}
        self.acquired: dict[bytes, tuple[TierHit, int]] = {}  # tier key -> (hit, pending loads of it)
        self.traces: dict[str, dict[str, list[int]]] = {}  # request id -> tier -> [queried, hit] blocks

    @property
    def tiers(self) -> list[Any]:
        return [t for t in (self.host, self.disk) if t is not None]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # ---- manager side (pure bookkeeping) -------------------------------------------------------
    def accepts_write_through(self) -> bool:
        """Whether a block just cached goes to the disk tier now (`KVExport.durable`): not while the disk is
        behind by more than its write budget (`DiskTier.write_budget`); a skipped block still goes at
        eviction or at exit."""
        return self.disk is not None and self.disk.queued_bytes < self.disk.write_budget

    def lookup(self, request_id: str, block_hash: bytes, token_ids: Sequence[int]) -> TierHit | None:
        """The fastest tier holding this block under this namespace, with its token ids confirmed."""
        key, tokens = tier_key(self.namespace, block_hash), tuple(token_ids)
        trace = self.traces.setdefault(request_id, {})
        for tier in self.tiers:
            counts = trace.setdefault(tier.name, [0, 0])
            counts[0] += 1
            if tier is self.host:
                slot = self.host.lookup(key, tokens)
                if slot is not None:
                    counts[1] += 1
                    return TierHit("host", key, block_hash, tokens, slot=slot)
            else:
                payload = self.disk.get(key, tokens)
                if payload is not None:
                    counts[1] += 1
                    return TierHit("disk", key, block_hash, tokens, payload=payload)
        return None

    def forget_lookup(self, request_id: str) -> None:
        """Drop a lookup's trace (the request was not admitted; it is looked up again later)."""
        self.traces.pop(request_id, None)

    def record_lookup(self, request_id: str) -> None:
        """Count an admitted request's tier lookups in tokens (once per admission)."""
        for name, (queried, hit) in self.traces.pop(request_id, {}).items():
            self.stats[name].query_tokens += queried * self.block_size
            self.stats[name].hit_tokens += hit * self.block_size

    def acquire(self, hit: TierHit, block_id: int) -> KVLoad:
        """The load of `hit` into device block `block_id` (run by `sync` before the next forward pass).

        A host hit's slot is pinned until then, so no export can overwrite it first.
        """
        if hit.tier == "host":
            self.host.index.pin(hit.key)
        _, n = self.acquired.get(hit.key, (hit, 0))
        self.acquired[hit.key] = (hit, n + 1)
        return KVLoad(0, hit.key, block_id)

    def should_swap(self, num_blocks: int) -> bool:
        """Swap a preempted request's blocks to the host tier instead of dropping them to recompute?"""
        if self.host is None or num_blocks == 0 or self.preemption_mode == "recompute":
            return False
        if self.preemption_mode == "swap" or self.swap_cost is None:
            return self.preemption_mode == "swap"
        return self.swap_cost.prefers_swap(num_blocks)

    # ---- runner side (moves bytes) -------------------------------------------------------------
    def sync(self, mover: Any, exports: Sequence[KVExport] = (), loads: Sequence[KVLoad] = ()) -> None:
        """Run `exports`, then `loads` (an evicted block is read before its new owner overwrites it)."""
        if exports:
            self._export(mover, exports)
        if loads:
            self._load(mover, loads)

    def _export(self, mover: Any, exports: Sequence[KVExport]) -> None:
        jobs, seen = [], set()
        for e in exports:
            key = tier_key(self.namespace, e.block_hash)
            to_host = self.host is not None and not e.durable and not self.host.contains(key)
            to_disk = self.disk is not None and not e.swap and not self.disk.contains(key)
            if (to_host or to_disk) and (key, to_host) not in seen:
                seen.add((key, to_host))
                jobs.append((e.block_id, key, e.token_ids, to_host, to_disk, e.swap))
        if not jobs:
            return
        rows = mover.export([j[0] for j in jobs])
        host_rows = [i for i, j in enumerate(jobs) if j[3]]
        if host_rows:
            self.host.put_rows([(jobs[i][1], jobs[i][2]) for i in host_rows],
                               rows if len(host_rows) == len(jobs) else rows[host_rows])
            self.stats["host"].blocks_stored += len(host_rows)
            self.stats["host"].swapped_out_blocks += sum(1 for i in host_rows if jobs[i][5])
        for i, (_, key, tokens, _, to_disk, _) in enumerate(jobs):
            if to_disk:
                self.disk.put(key, tokens, rows[i].numpy().tobytes())
                self.stats["disk"].blocks_stored += 1

    def _release(self, key: bytes) -> TierHit:
        hit, n = self.acquired[key]
        if n > 1:
            self.acquired[key] = (hit, n - 1)
        else:
            del self.acquired[key]
        return hit

    def _load(self, mover: Any, loads: Sequence[KVLoad]) -> None:
        start = time.perf_counter()
        hits = [(load.dst, self._release(load.key)) for load in loads]
        host = [(b, h) for b, h in hits if h.tier == "host"]
        disk = [(b, h) for b, h in hits if h.tier == "disk"]
        if host:
            mover.import_([b for b, _ in host], self.host.read([h.slot for _, h in host]))
            for _, h in host:
                self.host.index.unpin(h.key)
        if disk:
            mover.import_bytes([b for b, _ in disk], [h.payload for _, h in disk])
        elapsed = time.perf_counter() - start
        for name, done in (("host", host), ("disk", disk)):
            if done:
                st = self.stats[name]
                st.blocks_loaded += len(done)
                st.bytes_read += len(done) * mover.block_nbytes
                st.load_seconds += elapsed * len(done) / (len(host) + len(disk))

    # ---- lifecycle -----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per-tier counters plus live size, capacity and evictions."""
        out = {}
        for tier in self.tiers:
            st = self.stats[tier.name]
            st.evictions = tier.index.evictions
            st.bytes_written = tier.bytes_written
            out[tier.name] = {**st.as_dict(), "used_bytes": tier.used, "capacity_bytes": tier.capacity}
        return out

    def flush(self, mover: Any, exports: Sequence[KVExport]) -> None:
        """Write `exports` (the device's cached blocks) to the tiers and wait for the disk (shutdown, restart)."""
        self.sync(mover, exports)
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def flush_tiers_at_exit(tiers: KVTiers, mover: Any, kv: Any) -> None:
    """Write every cached device block to the tiers, wait for the disk, stop its writer (`LLMEngine.close`).

    Registered with `weakref.finalize`, so it also runs at interpreter exit and when an engine is collected:
    the finalizer holds these three objects, never the engine. A step cut off mid-way (Ctrl-C) left
    blocks published but unwritten; they lose their hash first, so no tier ever stores them.
    """
    kv.discard_unwritten()
    tiers.flush(mover, kv.take_block_exports() + kv.cached_block_exports())
    tiers.close()
