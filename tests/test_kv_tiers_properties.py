"""Property test: random allocate / append / free / evict-to-tier / hit-from-tier / swap / restart / corrupt.

The device cache is a real DenseKVCache whose every token slot holds a code for
the (cache salt, token prefix) it was computed for; bytes really move through the
host tier, the disk tier (files) and back. After every rule each live request
must read its own prefix codes through its block table: a block served under a
key that does not match (another prefix, another salt, a damaged file) fails this.
Tier sizes stay within their limits (the disk's files too), and the pool's ref
counts balance (check_integrity).
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.kv.tiers.block_io import BlockMover
from kvforge.kv.tiers.disk import DiskTier
from kvforge.kv.tiers.host import HostTier
from kvforge.kv.tiers.tiers import KVTiers
from kvforge.ledger import KVGroup

BS, NUM_BLOCKS, DIM = 2, 8, 4
HOST_SLOTS, DISK_BYTES = 5, 3000
NAMESPACE = b"property-test"
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=9)
SALT = st.sampled_from([None, None, "tenant"])


def code(salt: str | None, prefix: tuple[int, ...]) -> torch.Tensor:
    """What the forward pass would write at the last position of `prefix`: exact small integers."""
    digest = hashlib.sha256(repr((salt, prefix)).encode()).digest()
    return torch.tensor([int.from_bytes(digest[4 * i : 4 * i + 3], "little") for i in range(DIM)], dtype=torch.float32)


class TieredCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtiers-")
        self.ids = 0
        self._boot()

    def teardown(self) -> None:
        self.tiers.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _boot(self) -> None:
        """A fresh process: empty device pool and host tier, the same disk directory."""
        self.cache = DenseKVCache(NUM_BLOCKS + 1, BS, 1, DIM, DIM, torch.float32)  # + the null block
        self.mover = BlockMover([self.cache])
        host = HostTier(HOST_SLOTS * self.mover.block_nbytes, self.mover.block_nbytes)
        disk = DiskTier(self.dir, DISK_BYTES, NAMESPACE, background=False)
        self.tiers = KVTiers(NAMESPACE, BS, host, disk, preemption_mode="swap")
        self.kv = KVCacheCoordinator([KVGroup(None, (0,), NUM_BLOCKS)], BS)
        self.kv.attach_tiers(self.tiers)
        self.live: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}

    # ---- helpers ---------------------------------------------------------------------------
    def _compute(self, req: Request, n: int, hits: list | None = None) -> bool:
        copies = self.kv.allocate_slots(req, n, hits)
        if copies is None:
            return False
        self.tiers.sync(self.mover, self.kv.take_block_loads())  # what the runner does before the forward pass
        self.cache.copy_blocks(copies[0])
        table = self.kv.block_ids(req.request_id)[0]
        start = req.num_computed_tokens + (len(hits.blocks[0]) * BS if hits else 0)
        for p in range(start, start + n):
            c = code(req.cache_salt, tuple(req.all_token_ids[: p + 1]))
            self.cache.k[table[p // BS], p % BS, 0] = c
            self.cache.v[table[p // BS], p % BS, 0] = -c
        req.num_computed_tokens = start + n
        return True

    def _admit(self, req: Request) -> None:
        hits, num_cached = self.kv.get_computed_blocks(req)
        req.num_computed_tokens = 0
        if self._compute(req, req.num_tokens - num_cached, hits):
            self.kv.record_lookup(req, num_cached)
            self.live[req.request_id] = req
        else:
            self.tiers.forget_lookup(req.request_id)

    # ---- rules -----------------------------------------------------------------------------
    @rule(tokens=TOKENS, salt=SALT)
    def new_request(self, tokens: list[int], salt: str | None) -> None:
        self.ids += 1
        self._admit(Request(f"r{self.ids}", tokens, SamplingParams(), cache_salt=salt))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data: st.DataObject, token: int) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.append_token(token)
        if not self._compute(req, 1):
            req.all_token_ids.pop()
            req.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        if self.kv.should_swap(req):
            self.kv.swap_out(req)
        self.kv.free(req)
        req.num_preemptions += 1
        self.swapped[req.request_id] = req

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req = self.swapped.pop(data.draw(st.sampled_from(sorted(self.swapped))))
        self._admit(req)

    @rule(flush=st.booleans())
    def restart(self, flush: bool) -> None:
        """The process ends (flushing its cached blocks, or crashing) and a new one starts on the same directory."""
        self.tiers.sync(self.mover)
        if flush:
            self.tiers.flush(self.mover, [(b.block_id, b.block_hash, b.token_ids) for b in self.kv.pools[0].blocks
                                          if b.block_hash is not None and b.token_ids is not None])
        self.tiers.close()
        self._boot()

    @rule(seed=st.integers(0, 1000))
    def corrupt_a_file(self, seed: int) -> None:
        files = sorted(os.path.join(r, f) for r, _, fs in os.walk(self.dir) for f in fs if f.endswith(".kvb"))
        if files:
            rng = random.Random(seed)
            path = rng.choice(files)
            blob = bytearray(open(path, "rb").read())
            if not blob:
                return
            if rng.random() < 0.5:
                blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
            else:
                blob = blob[: rng.randrange(len(blob))]
            with open(path, "wb") as f:
                f.write(blob)

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def every_request_reads_its_own_prefix(self) -> None:
        for req in self.live.values():
            table = self.kv.block_ids(req.request_id)[0]
            for p in range(req.num_computed_tokens):
                c = code(req.cache_salt, tuple(req.all_token_ids[: p + 1]))
                assert torch.equal(self.cache.k[table[p // BS], p % BS, 0], c), f"{req.request_id} position {p}"
                assert torch.equal(self.cache.v[table[p // BS], p % BS, 0], -c)

    @invariant()
    def tiers_within_limits(self) -> None:
        host, disk = self.tiers.host, self.tiers.disk
        assert host.used <= host.capacity and len(host.index) <= host.num_slots
        assert disk.used <= disk.capacity
        on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(self.dir) for f in fs
                      if f.endswith(".kvb"))
        assert on_disk <= disk.capacity

    @invariant()
    def ref_counts_balance(self) -> None:
        self.kv.check_integrity()


TieredCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tiered_cache_state_machine = TieredCacheMachine.TestCase
