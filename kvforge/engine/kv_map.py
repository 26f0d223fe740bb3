"""KVMapObserver: the engine's side of the live KV block map (`/kv`, `kvforge top`).

Why here: the events the map shows are decided in one step by several parts (the scheduler
admits and preempts, the coordinator copies on write and loads tier blocks, eviction drops
blocks), and all of them are visible in the step's `SchedulerOutput` and the counters the
engine already keeps. So the observer reads those after each step — a few list walks over
the step's chunks, nothing over the pool — and the pool itself is read only when a viewer
asks for a snapshot (`kv/block_map.py`), on the engine thread, between two steps.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from kvforge.kv.block_map import StepWrites, build_snapshot
from kvforge.kv.events import KVEventLog

if TYPE_CHECKING:
    from kvforge.engine.request import Request
    from kvforge.engine.scheduler import SchedulerOutput


MAX_EVENT_BLOCK_IDS = 64  # block ids an `evict` event lists per group; a bigger drop lists its first 64


class KVMapObserver:
    """Owned by the `LLMEngine` (typed `Any` here: engine.py imports this module, not the reverse)."""

    def __init__(self, capacity: int = 512, history: int = 300) -> None:
        self.events = KVEventLog(capacity)
        # the gauges of the last `history` steps, so a page opened mid-run draws the curves from the start:
        # (step, pool usage, prefix hit rate, utilization, waste of a contiguous reservation)
        self.history: deque[tuple[int, float, float, float, float | None]] = deque(maxlen=history)
        self.step = 0
        self._running: set[str] = set()  # request ids running after the previous step
        self._chunks: list[tuple[int, int, list[list[int]]]] = []  # the last step's writes, read lazily
        self._shifts: dict[int, int] = {}
        self._tier_stored: dict[str, int] = {}
        self._reclaimed = 0

    def after_step(self, out: "SchedulerOutput", engine: Any) -> None:
        """Record the step's events; called once the runner wrote its K/V (before eviction cuts tables)."""
        self.step += 1
        step = self.step
        swapped = set(getattr(out, "swapped", ()))
        for req in out.preempted:
            self.events.record("preempt", step, request=req.request_id,
                               mode="swap" if req.request_id in swapped else "recompute")
        for chunk in out.chunks:
            req = chunk.request
            if req.request_id not in self._running:
                # a re-admission after preemption needs its prompt and the tokens it generated so far
                self.events.record("admit", step, request=req.request_id, prompt_tokens=req.num_prompt_tokens,
                                   tokens=req.num_tokens, cached_tokens=chunk.start,
                                   by_tier=dict(req.admitted_tokens_by_tier), recompute=req.num_preemptions > 0)
        for g, pairs in enumerate(out.block_copies):
            for src, dst in pairs:
                self.events.record("cow", step, group=g, src=src, dst=dst)
        if out.block_loads:
            self.events.record("tier_load", step, blocks=[load.dst for load in out.block_loads])
        for name, stats in engine.tier_stats().items():
            stored = int(stats.get("blocks_stored", 0))
            if stored > self._tier_stored.get(name, 0):
                self.events.record("tier_store", step, tier=name, blocks=stored - self._tier_stored.get(name, 0))
            self._tier_stored[name] = stored
        reclaimed = engine.kv.pool.num_evictions
        if reclaimed > self._reclaimed:
            self.events.record("reclaim", step, blocks=reclaimed - self._reclaimed)
        self._reclaimed = reclaimed
        self._running = {r.request_id for r in engine.scheduler.running}
        self._record_gauges(engine)
        self._chunks = [(c.start, c.num_tokens, c.block_ids) for c in out.chunks]
        self._shifts = {i: c.request.num_evicted_tokens for i, c in enumerate(out.chunks) if c.request.num_evicted_tokens}

    def _record_gauges(self, engine: Any) -> None:
        """O(1) a step: every input is a counter the engine keeps (utilization was measured this step)."""
        kv, use = engine.kv, engine.kv_usage.last
        contiguous = engine.scheduler_config.max_model_len * len(engine.scheduler.running) * kv.num_groups
        waste = 1.0 - use.tokens_stored / contiguous if contiguous else None
        self.history.append((self.step, kv.pool.usage, kv.stats.hit_rate, use.utilization, waste))

    def on_evict(self, req: "Request", dropped: list[list[int]], policy: str) -> None:
        """An eviction policy dropped the blocks `dropped` (ids per group) from `req`'s tables this step.

        The event carries `blocks` (how many, group 0's count: the logical blocks dropped) and
        `block_ids` per group, each cut to its first MAX_EVENT_BLOCK_IDS so a huge drop stays a small
        event (`len(block_ids[g]) < blocks` says the list was cut)."""
        if any(dropped):
            self.events.record("evict", self.step, request=req.request_id, blocks=len(dropped[0]), policy=policy,
                               block_ids=[ids[:MAX_EVENT_BLOCK_IDS] for ids in dropped])

    def snapshot(self, engine: Any, since: int | None = None, max_events: int = 200) -> dict[str, Any]:
        """The map as of the last step, with the events from sequence `since` on (None: the newest only)."""
        kv = engine.kv
        writes = StepWrites.from_chunks(self._chunks, kv.block_size, kv.num_groups,
                                        [p.null_block.block_id for p in kv.pools], self._shifts,
                                        [m.evicts for m in kv.managers])
        scheduler = engine.scheduler
        snap = build_snapshot(kv, list(scheduler.running), list(scheduler.waiting), writes,
                              engine.scheduler_config.max_model_len, self.step, engine.tier_stats())
        snap["events"] = self.events.since(since if since is not None else 0, max_events)
        snap["next_event"] = self.events.next_seq
        snap["preemptions"] = scheduler.num_preemptions
        snap["history"] = [list(h) for h in self.history]
        return snap
