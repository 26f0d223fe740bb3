"""KV-affinity routing across engine replicas: exact knowledge of each replica's cached blocks.

Why exact: kvforge's replicas and this router compute the same block hash chain
(`kvforge.kv.hashing`: SHA-256 over the parent hash, the block's token ids and, in the first
block, the request's `cache_salt`). Each replica reports which block hashes it stored and which it
evicted, so the router knows what every replica holds instead of guessing from the prompts it sent
(as prefix-tree routers do). Salt isolation is free: requests with different salts have
different chains from the first block on, so they never match each other's blocks.

Policy (`route`): the replica holding the longest run of the request's leading block hashes wins,
unless it is overloaded compared with the least loaded replica: its load exceeds the least
loaded one's by more than `max_load_diff` requests AND by a factor of more than `max_load_ratio`
(sglang's cache_aware guard has the same two-sided shape). Then, or when nobody holds a prefix,
the least loaded replica is chosen. Load = max(requests the replica last reported running +
waiting, requests this router sent it that have not finished) + its KV utilisation (0..1, a
tie-breaker between equally busy replicas).

A request routed to a replica will soon hold its prompt's blocks there, before the replica
reports them: the router records them as *pending* on that replica for `pending_ttl` seconds
(or until the replica reports them stored or evicted), so a burst of requests with a new shared
prefix lands on one replica instead of spreading before the first report arrives.

Pure Python, no torch: the Ray front deployment, the benchmark and the tests use it directly.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

ReplicaId = Hashable

AFFINITY = "affinity"  # sent to the replica holding the longest prefix
LOAD_FALLBACK = "load_fallback"  # a replica held a prefix but was overloaded: least loaded instead
NO_PREFIX = "no_prefix"  # nobody held any block of the prompt: least loaded


@dataclass
class RouterConfig:
    max_load_ratio: float = 1.5  # affinity target may be up to this factor above the least loaded ...
    # ... or up to this many requests above it (both must be exceeded to fall back). A fallback turns a hit into
    # a full prefill of the prefix elsewhere, and duplicates it in a second pool: at 4, the shared-prefix benchmark
    # (benchmarks/routing.py, 8 x 1K-token prefixes, pools holding ~5) fell back often enough to lose to the
    # prefix-tree router (mean TTFT 5.9 s vs 3.5 s); at 16 it matched or beat it. sglang's and vllm-router's
    # cache_aware default is 64 (with the same 1.5 ratio); 16 keeps a dead-slow replica from collecting a queue.
    max_load_diff: float = 16.0
    pending_ttl: float = 30.0  # seconds routed-but-unreported blocks count as held by their replica

    def __post_init__(self) -> None:
        if not self.max_load_ratio >= 1.0:
            raise ValueError(f"max_load_ratio must be >= 1, got {self.max_load_ratio!r}")
        if not self.max_load_diff >= 0:
            raise ValueError(f"max_load_diff must be >= 0, got {self.max_load_diff!r}")
        if not self.pending_ttl >= 0:
            raise ValueError(f"pending_ttl must be >= 0 seconds, got {self.pending_ttl!r}")


@dataclass
class ReplicaState:
    blocks: set = field(default_factory=set)  # block hashes the replica reported stored and not evicted
    pending: dict = field(default_factory=dict)  # hash -> expiry time: routed here, not reported yet
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0  # routed by this router and not finished
    routed: int = 0
    matched_blocks: int = 0  # blocks of routed prompts this replica already held (router's view)
    prompt_blocks: int = 0

    def holds(self, h: bytes, now: float) -> bool:
        if h in self.blocks:
            return True
        expiry = self.pending.get(h)
        if expiry is None:
            return False
        if expiry < now:
            del self.pending[h]
            return False
        return True


@dataclass(frozen=True)
class Decision:
    replica: ReplicaId
    kind: str  # AFFINITY, LOAD_FALLBACK or NO_PREFIX
    matched_blocks: int  # leading blocks of the prompt the chosen replica holds


class KVAffinityRouter:
    def __init__(self, config: RouterConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RouterConfig()
        self.clock = clock
        self.replicas: dict[ReplicaId, ReplicaState] = {}
        self.decisions = {AFFINITY: 0, LOAD_FALLBACK: 0, NO_PREFIX: 0}

    # ---- replica membership and reports ----------------------------------------------------
    def add_replica(self, replica: ReplicaId) -> None:
        self.replicas.setdefault(replica, ReplicaState())

    def remove_replica(self, replica: ReplicaId) -> None:
        """A replica that died or left: its blocks are gone, nothing is routed to it any more."""
        self.replicas.pop(replica, None)

    def on_events(self, replica: ReplicaId, stored: Iterable[bytes] = (), evicted: Iterable[bytes] = ()) -> None:
        """Block-hash events from `replica`, in the order they happened (stored, then evicted)."""
        state = self.replicas.setdefault(replica, ReplicaState())
        for h in stored:
            state.blocks.add(h)
            state.pending.pop(h, None)
        for h in evicted:
            state.blocks.discard(h)
            state.pending.pop(h, None)

    def on_snapshot(self, replica: ReplicaId, hashes: Iterable[bytes]) -> None:
        """The full set of hashes `replica` holds (a new or restarted replica)."""
        state = self.replicas.setdefault(replica, ReplicaState())
        state.blocks = set(hashes)
        state.pending.clear()

    def on_load(self, replica: ReplicaId, running: int, waiting: int, kv_usage: float) -> None:
        state = self.replicas.setdefault(replica, ReplicaState())
        state.running, state.waiting, state.kv_usage = running, waiting, kv_usage

    def finished(self, replica: ReplicaId) -> None:
        """A request this router sent to `replica` completed (or failed)."""
        state = self.replicas.get(replica)
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    # ---- routing ------------------------------------------------------------------------------
    def load(self, replica: ReplicaId) -> float:
        s = self.replicas[replica]
        return max(s.running + s.waiting, s.inflight) + s.kv_usage

    def prefix_match(self, replica: ReplicaId, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the prompt `replica` holds."""
        state, now = self.replicas[replica], self.clock()
        n = 0
        for h in hashes:
            if not state.holds(h, now):
                break
            n += 1
        return n

    def choose(self, hashes: Sequence[bytes], exclude: Iterable[ReplicaId] = ()) -> Decision:
        """The routing decision for a prompt's block hashes, without recording it."""
        skip = set(exclude)
        candidates = [r for r in self.replicas if r not in skip]
        if not candidates:
            raise LookupError("no replica is available")
        loads = {r: self.load(r) for r in candidates}
        least = min(candidates, key=lambda r: loads[r])  # first listed wins ties: deterministic
        matches = {r: self.prefix_match(r, hashes) for r in candidates}
        best = max(candidates, key=lambda r: (matches[r], -loads[r]))
        if matches[best] == 0:
            return Decision(least, NO_PREFIX, matches[least])
        cfg = self.config
        lo, hi = loads[least], loads[best]
        if hi - lo > cfg.max_load_diff and hi > cfg.max_load_ratio * lo:
            return Decision(least, LOAD_FALLBACK, matches[least])
        return Decision(best, AFFINITY, matches[best])

    def route(self, hashes: Sequence[bytes], exclude: Iterable[ReplicaId] = ()) -> Decision:
        """Choose a replica and record it: counts, in-flight load, the prompt's blocks as pending there."""
        d = self.choose(hashes, exclude)
        self.record(d, hashes)
        return d

    def record(self, d: Decision, hashes: Sequence[bytes]) -> None:
        """Account a request sent to `d.replica` (which a caller may have overridden after `choose`)."""
        state = self.replicas.get(d.replica)
        if state is None:
            return
        state.inflight += 1
        state.routed += 1
        state.matched_blocks += d.matched_blocks
        state.prompt_blocks += len(hashes)
        if self.config.pending_ttl > 0:
            expiry = self.clock() + self.config.pending_ttl
            for h in hashes:
                if h not in state.blocks:
                    state.pending[h] = expiry
        self.decisions[d.kind] += 1

    def stats(self) -> dict:
        """Per-replica view for /metrics: routed requests, in-flight, held blocks, expected hit rate."""
        return {
            "decisions": dict(self.decisions),
            "replicas": {
                str(r): {"routed": s.routed, "inflight": s.inflight, "blocks": len(s.blocks),
                         "running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage,
                         "routed_prefix_hit_rate": s.matched_blocks / s.prompt_blocks if s.prompt_blocks else 0.0}
                for r, s in self.replicas.items()
            },
        }


class BlockIndexDiff:
    """Turns snapshots of a replica's prefix index into stored/evicted events.

    The replica side of the protocol: `diff(current hashes)` returns what appeared and what
    disappeared since the last call, which is what the router's `on_events` consumes.
    """

    def __init__(self) -> None:
        self.known: set = set()

    def diff(self, current: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        now = set(current)
        stored, evicted = list(now - self.known), list(self.known - now)
        self.known = now
        return stored, evicted
