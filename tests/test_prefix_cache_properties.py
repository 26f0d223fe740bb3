"""Property tests: random allocate / append / fork / free / preempt / reset sequences on the KV manager.

A shadow memory stands in for the KV tensors: every slot records which token
prefix (and cache salt) its K/V was computed for. After each rule, every
computed position of every live request must read back its own prefix through
its block table; this catches a wrong prefix hit, a missed copy-on-write, a
hit across cache salts, or a block reused while still referenced. The pool's
own invariants (check_integrity) must hold too, cached hashes must map to
blocks whose contents match, and nothing may leak at the end.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.kv.hashing import extend_block_hashes
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.kv.interface import KVCacheBlocks
from kvforge.ledger import KVGroup

BS = 2
NUM_BLOCKS = 12
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # a tiny alphabet makes shared prefixes common
SALT = st.sampled_from([None, None, "tenant"])


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheCoordinator([KVGroup(None, (0,), NUM_BLOCKS)], BS)
        self.pool = self.kv.pools[0]
        self.memory: dict[int, list[object]] = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.live: dict[str, Request] = {}  # requests holding blocks
        self.waiting: dict[str, Request] = {}  # new or preempted, holding none
        self.ids = 0

    # ---- helpers --------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.ids += 1
        return f"r{self.ids}"

    def _snapshot(self) -> tuple:
        pool = self.pool
        return [b.ref_cnt for b in pool.blocks], list(pool.free_queue), dict(pool.cached)

    def _compute(self, req: Request, n: int, hits: KVCacheBlocks | None = None) -> bool:
        """allocate_slots + the writes the forward pass would do; False (nothing changed) if no room."""
        before = self._snapshot()
        copies = self.kv.allocate_slots(req, n, hits)
        if copies is None:
            assert self._snapshot() == before, "a failed allocation changed the pool"
            return False
        (group_copies,) = copies
        for src, dst in group_copies:  # the runner copies before the forward writes
            self.memory[dst] = list(self.memory[src])
        table = self.kv.block_ids(req.request_id)[0]
        start = req.num_computed_tokens + (len(hits.blocks[0]) * BS if hits else 0)
        for p in range(start, start + n):
            self.memory[table[p // BS]][p % BS] = (req.cache_salt, tuple(req.all_token_ids[: p + 1]))
        req.num_computed_tokens = start + n
        return True

    def _admit(self, req: Request, chunk: int) -> None:
        hits, cached = self.kv.get_computed_blocks(req)
        assert cached == len(hits.blocks[0]) * BS and cached < req.num_tokens
        n = min(chunk, req.num_tokens - cached)
        if self._compute(req, n, hits):
            self.kv.record_lookup(req, cached)
            self.waiting.pop(req.request_id, None)
            self.live[req.request_id] = req
        else:
            self.waiting[req.request_id] = req

    # ---- rules ----------------------------------------------------------------------------
    @rule(tokens=TOKENS, salt=SALT, chunk=st.integers(1, 9))
    def add(self, tokens, salt, chunk):
        self._admit(Request(self._new_id(), tokens, SamplingParams(), cache_salt=salt), chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def admit_waiting(self, data, chunk):
        self._admit(self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))], chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2), chunk=st.integers(1, 4))
    def advance(self, data, token, chunk):
        """A prefill chunk, or (all tokens computed) a sampled token followed by its decode step."""
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token)
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        self._compute(req, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = Request(self._new_id(), parent.prompt_token_ids, SamplingParams(), cache_salt=parent.cache_salt,
                        all_token_ids=list(parent.all_token_ids))
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live or self.waiting)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live) + sorted(self.waiting)))
        req = self.live.pop(rid, None) or self.waiting.pop(rid)
        self.kv.free(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting[req.request_id] = req

    @rule()
    def reset(self):
        in_use = bool(self.live)
        assert self.kv.reset_prefix_cache() is (not in_use)
        if not in_use:
            assert self.pool.num_cached_blocks == 0

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def pool_integrity(self):
        self.kv.check_integrity()
        assert set(self.kv.managers[0].tables) == set(self.live)

    @invariant()
    def every_computed_position_reads_its_own_prefix(self):
        for req in self.live.values():
            table = self.kv.block_ids(req.request_id)[0]
            assert len(table) * BS >= req.num_computed_tokens
            for p in range(req.num_computed_tokens):
                got = self.memory[table[p // BS]][p % BS]
                assert got == (req.cache_salt, tuple(req.all_token_ids[: p + 1])), (req.request_id, p, got)

    @invariant()
    def cached_hashes_match_block_contents(self):
        for h, block in self.pool.cached.items():
            salt, prefix = self.memory[block.block_id][BS - 1]
            assert block.token_ids == prefix[-BS:]
            assert extend_block_hashes([], prefix, BS, (salt,) if salt else ())[-1] == h

    def teardown(self):
        for req in list(self.live.values()) + list(self.waiting.values()):
            self.kv.free(req)
        self.kv.check_integrity()
        assert self.pool.num_free_blocks == NUM_BLOCKS and not self.kv.managers[0].tables


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
