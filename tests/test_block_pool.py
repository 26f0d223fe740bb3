"""Block pool and KV coordinator (one group), scripted: exact block ids, ref counts, free-queue and eviction order.

Pure Python (no model): a block size of 4 and a 10-block pool keep every id predictable.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvforge.config import SchedulerConfig
from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.kv.blocks import BlockPool
from kvforge.kv.hashing import extend_block_hashes, hash_block
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.ledger import KVGroup

BS = 4


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def _kv(num_blocks: int) -> KVCacheCoordinator:
    return KVCacheCoordinator([KVGroup(None, (0,), num_blocks)], BS)


def _admit(kv: KVCacheCoordinator, req: Request) -> list[int]:
    """Admission as the scheduler does it: prefix lookup, then room for the uncached rest."""
    hits, cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - cached, hits) == [[]]
    kv.record_lookup(req, cached)
    req.num_computed_tokens = req.num_tokens
    return kv.block_ids(req.request_id)[0]


def _refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def _queue(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


@pytest.fixture
def kv() -> KVCacheCoordinator:
    return _kv(10)


def test_scripted_sharing_freeing_and_hits(kv):
    pool = kv.pools[0]
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert _admit(kv, a) == [0, 1, 2]
    assert _refs(pool) == [1, 1, 1] + [0] * 7
    assert pool.num_cached_blocks == 2  # the partial last block is never hashed
    assert pool.blocks[2].block_hash is None

    # shared prefix, hit on blocks in use: ref counts rise, only the rest is new
    b = _req("b", list(range(8)) + [50, 51, 52])
    hits, cached = kv.get_computed_blocks(b)
    assert hits.get_block_ids()[0] == [0, 1] and cached == 8
    assert _admit(kv, b) == [0, 1, 3]
    assert _refs(pool) == [2, 2, 1, 1] + [0] * 6
    assert _queue(pool) == [4, 5, 6, 7, 8, 9]

    # freeing is tail-first; shared blocks stay referenced
    kv.free(a)
    assert _refs(pool) == [1, 1, 0, 1] + [0] * 6
    assert _queue(pool) == [4, 5, 6, 7, 8, 9, 2]
    kv.free(b)
    assert _queue(pool) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]  # chain tail (1) before head (0)
    assert pool.num_cached_blocks == 2  # freed blocks stay hittable

    # hit on a freed-but-cached block: it leaves the middle of the free queue
    c = _req("c", [0, 1, 2, 3, 9, 9, 9, 9, 7])
    assert _admit(kv, c) == [0, 4, 5]
    assert _queue(pool) == [6, 7, 8, 9, 2, 3, 1]
    assert _refs(pool)[:6] == [1, 0, 0, 0, 1, 1]
    assert pool.num_cached_blocks == 3  # c's second block [9, 9, 9, 9] joined the index
    kv.check_integrity()


def test_eviction_follows_lru_order_when_pool_fills(kv):
    pool = kv.pools[0]
    a = _req("a", list(range(12)) + [99])  # blocks 0, 1, 2 full (cached), 3 partial
    assert _admit(kv, a) == [0, 1, 2, 3]
    kv.free(a)
    assert _queue(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    cached_ids = {b.block_id for b in pool.cached.values()}
    assert cached_ids == {0, 1, 2}
    # 7 new blocks take the never-cached ones, then the uncached partial block 3: nothing evicted yet
    d = _req("d", [200 + i for i in range(26)])
    assert _admit(kv, d) == [4, 5, 6, 7, 8, 9, 3]
    assert pool.num_evictions == 0 and _queue(pool) == [2, 1, 0]
    # the next allocation evicts the chain's tail first: block 2, then 1, keeping the head (0)
    e = _req("e", [300 + i for i in range(5)])
    assert _admit(kv, e) == [2, 1]
    assert pool.num_evictions == 2
    assert {b.block_id for b in pool.cached.values()} == {0} | {4, 5, 6, 7, 8, 9} | {2}
    assert _queue(pool) == [0]
    # the head block still hits
    f = _req("f", list(range(4)) + [1])
    hits, cached = kv.get_computed_blocks(f)
    assert hits.get_block_ids()[0] == [0] and cached == 4
    for r in (d, e):
        kv.free(r)
    kv.check_integrity()


def test_failed_allocation_leaves_ref_counts_untouched(kv):
    pool = kv.pools[0]
    a = _req("a", list(range(9)))
    _admit(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free
    hog = _req("hog", [100 + i for i in range(20)])
    assert _admit(kv, hog) == [3, 4, 5, 6, 7]
    before_refs, before_queue = _refs(pool), _queue(pool)
    big = _req("big", list(range(8)) + [7] * 20)  # hits 0, 1 but needs 5 more blocks; 3 are left
    hits, cached = kv.get_computed_blocks(big)
    assert hits.get_block_ids()[0] == [0, 1]
    assert kv.allocate_slots(big, big.num_tokens - cached, hits) is None
    assert _refs(pool) == before_refs and _queue(pool) == before_queue
    assert kv.block_ids("big") == [[]] and "big" not in kv.managers[0].tables
    kv.free(big)
    kv.free(hog)
    kv.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_last_prompt_token_is_always_recomputed(kv):
    a = _req("a", list(range(8)))
    _admit(kv, a)
    again = _req("again", list(range(8)))  # both blocks cached, but the last token's logits are needed
    hits, cached = kv.get_computed_blocks(again)
    assert cached == 4 and hits.get_block_ids()[0] == [0]
    longer = _req("longer", list(range(9)))
    assert kv.get_computed_blocks(longer)[1] == 8


def test_hit_is_confirmed_by_token_ids(kv):
    pool = kv.pools[0]
    a = _req("a", list(range(5)))
    _admit(kv, a)
    ((h, block),) = pool.cached.items()
    # forge a collision: another prefix whose hash is h must not be served block 0's KV
    assert pool.get_cached_block(h, [0, 1, 2, 3]) is block
    assert pool.get_cached_block(h, [0, 1, 2, 4]) is None
    b = _req("b", [0, 1, 2, 4, 5])
    b.block_hashes[:] = [h]  # pretend b's first block hashed to h
    hits, cached = kv.get_computed_blocks(b)
    assert hits.get_block_ids() == [[]] and cached == 0


def test_cache_salt_isolates_tenants(kv):
    tokens = list(range(9))
    _admit(kv, _req("a", tokens, salt="tenant-a"))
    assert kv.get_computed_blocks(_req("b", tokens, salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(_req("c", tokens))[1] == 0
    assert kv.get_computed_blocks(_req("d", tokens, salt="tenant-a"))[1] == 8


def test_hash_chain_covers_parent_and_is_stable_across_processes():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt",)) != h0
    assert extend_block_hashes([], list(range(11)), 4) == extend_block_hashes([], list(range(8)), 4)
    code = ("from kvforge.kv.hashing import extend_block_hashes as e;"
            "print(e([], list(range(40)), 16, ('s',))[-1].hex())")
    seen = {
        subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed, "PATH": ""},
                       capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("1", "2")
    }
    assert seen == {extend_block_hashes([], list(range(40)), 16, ("s",))[-1].hex()}


def test_reset_prefix_cache_refuses_while_blocks_in_use(kv):
    a = _req("a", list(range(9)))
    _admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.pools[0].num_cached_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.pools[0].num_cached_blocks == 0
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 0
    kv.check_integrity()


def test_fork_shares_blocks_and_copies_a_partial_block_on_write(kv):
    pool = kv.pools[0]
    parent = _req("p", list(range(6)))  # block 0 full, block 1 holds 2 tokens
    _admit(kv, parent)
    kids = [_req(f"p#{i}", list(range(6))) for i in (1, 2, 3)]
    for k in kids:
        k.num_computed_tokens = 6
        kv.fork(parent, k)
    assert _refs(pool)[:2] == [4, 4]
    copies = []
    for r in (parent, *kids):  # each sample writes its 7th token into the shared partial block 1
        r.append_token(42)
        copies.append(kv.allocate_slots(r, 1))
    # three samples copy; the last holder writes in place
    assert copies == [[[(1, 2)]], [[(1, 3)]], [[(1, 4)]], [[]]]
    assert [kv.block_ids(r.request_id)[0] for r in (parent, *kids)] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert _refs(pool)[:5] == [4, 1, 1, 1, 1] and kv.num_cow_copies == 3
    kv.check_integrity()
    for r in (parent, *kids):
        kv.free(r)
    assert pool.num_free_blocks == pool.num_blocks


def test_stats_count_each_admission_once_and_recompute_apart():
    kv = _kv(8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add_request(_req("a", list(range(17))))
    out = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 0, 17)]
    sched.update(out, {"a": 500})
    # b shares a's first 4 blocks but needs 4 more while only 3 are free: it waits for several steps
    sched.add_request(_req("b", list(range(16)) + [60] * 13))
    for _ in range(3):
        out = sched.schedule()
        assert [c.request.request_id for c in out.chunks] == ["a"]
        sched.update(out, {"a": 501})
    assert (kv.stats.queries, kv.stats.hits) == (17, 0)  # b's failed attempts are not counted
    sched.finish("a", sched.requests["a"].status.FINISHED_LENGTH)
    out = sched.schedule()
    # only b's 13 uncached tokens are scheduled (and charged to the budget)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("b", 16, 13)]
    assert (kv.stats.queries, kv.stats.hits) == (17 + 29, 16)
    assert kv.stats.hit_rate == pytest.approx(16 / 46)
    sched.update(out, {"b": 7})
    # preemption: the recompute lookup is counted apart
    victim = sched.running.pop()
    sched._preempt(victim)
    out = sched.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(28, 2)]
    assert (kv.stats.queries, kv.stats.hits) == (46, 16)
    assert (kv.stats.recompute_queries, kv.stats.recompute_hits) == (30, 28)
    sched.finish("b", sched.requests["b"].status.FINISHED_LENGTH)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_recent_window_hit_rate():
    kv = _kv(4)
    stats = kv.stats.__class__(window_size=2)
    stats.record(10, 0, recompute=False)
    stats.record(10, 10, recompute=False)
    stats.record(10, 10, recompute=False)
    assert stats.hit_rate == pytest.approx(20 / 30)
    assert stats.recent_hit_rate == 1.0


def test_blocks_a_step_publishes_are_hit_only_after_it_ran(kv):
    """Within an open step, a block published by this step's allocations is not hittable (its K/V is not
    written yet); `finish_step` makes it hittable; a step never finished leaves its blocks unhashed."""
    pool = kv.pools[0]
    kv.begin_step()
    assert _admit(kv, _req("a", list(range(9)))) == [0, 1, 2]
    b = _req("b", list(range(9)))
    assert kv.get_computed_blocks(b)[1] == 0 and kv.waits_for_fill(b, 0)  # same step: a's blocks are being written
    kv.finish_step()
    assert kv.get_computed_blocks(b)[1] == 8 and not kv.waits_for_fill(b, 8)
    kv.begin_step()  # this step fails: finish_step never comes
    assert _admit(kv, _req("c", list(range(100, 109)))) == [3, 4, 5]
    kv.begin_step()  # the next step: c's published blocks hold no K/V and lose their hash
    assert pool.num_cached_blocks == 2 and pool.blocks[3].block_hash is None and pool.num_evictions == 0
    assert kv.get_computed_blocks(_req("d", list(range(100, 109))))[1] == 0
    kv.finish_step()
    kv.check_integrity()
