"""The one KV coordinator: the same script gives exact per-group results for a plain model (one group)
and a hybrid local/global model (a full group and a windowed group), in pure Python.

Also the contract pieces the next KV features build on: block ids and copies per group in
`SchedulerOutput` (the runner never asks the coordinator), the request-owned hash chain, the
reserved null block, `evict_blocks` (KV eviction) and the pool's evict hook (KV tiers).
"""
from __future__ import annotations

import pytest

from conftest import prefill_then_decode
from kvforge.config import SchedulerConfig
from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.kv.hashing import extend_block_hashes
from kvforge.kv.interface import KVCacheCoordinatorProtocol
from kvforge.ledger import KVGroup

BS, WINDOW, N = 4, 8, 12
NULL = N  # every pool's reserved null block: one id past its usable blocks
GROUPS = {
    "single": [KVGroup(None, (0, 1, 2), N)],
    "hybrid": [KVGroup(None, (1,), N), KVGroup(WINDOW, (0, 2), N)],
}
# Per scenario, per group: what the same operations must give.
EXPECTED = {
    "single": {
        "tables": [list(range(9))],  # 34 tokens: 9 blocks, all kept
        "held": [9],
        "hits": [[0, 1, 2, 3, 4, 5]],  # the whole 24-token prompt is cached
        "cow": [[(1, 2)]],
    },
    "hybrid": {
        # the local group freed the blocks no query can see any more (ending before 33 - 8): null in their slots
        "tables": [list(range(9)), [NULL] * 6 + [6, 7, 8]],
        "held": [9, 3],
        # the local group needs only the blocks the window sees once 24 tokens are computed
        "hits": [[0, 1, 2, 3, 4, 5], [NULL] * 4 + [4, 5]],
        "cow": [[(1, 2)], [(1, 2)]],
    },
}


@pytest.fixture(params=list(GROUPS))
def case(request) -> tuple[KVCacheCoordinator, dict]:
    return KVCacheCoordinator(GROUPS[request.param], BS), EXPECTED[request.param]


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def test_the_coordinator_satisfies_its_protocol(case):
    kv, _ = case
    proto: KVCacheCoordinatorProtocol = kv  # mypy checks this assignment; the asserts check the shapes
    assert proto.num_groups == len(kv.groups) == len(kv.pools)


def test_same_script_exact_per_group_results(case):
    kv, want = case
    prompt = list(range(100, 124))  # 6 full blocks
    a = _req("a", prompt)
    prefill_then_decode(kv, a, 10)
    assert kv.block_ids("a") == want["tables"]
    assert kv.num_held_blocks("a") == want["held"]
    # the request's hash chain: one per full block, computed once and shared by every group
    assert a.block_hashes == extend_block_hashes([], a.all_token_ids, BS)[: len(a.block_hashes)]
    assert len(a.block_hashes) == 8  # 33 tokens written: 8 full blocks published

    b = _req("b", prompt + [1])
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 24 and hits.get_block_ids() == want["hits"]
    assert kv.allocate_slots(b, 1, hits) == [[] for _ in want["hits"]]
    kv.record_lookup(b, cached)
    assert (kv.stats.queries, kv.stats.hits) == (25, 24)
    kv.free(b)
    kv.free(a)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks == N * kv.num_groups


def test_copy_on_write_pairs_per_group(case):
    kv, want = case
    parent = _req("p", list(range(6)))  # block 0 full, block 1 holds 2 tokens
    prefill_then_decode(kv, parent, 0)
    child = _req("p#1", list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert child.block_hashes == parent.block_hashes and child.block_hashes is not parent.block_hashes
    copies = []
    for r in (parent, child):
        r.append_token(42)
        copies.append(kv.allocate_slots(r, 1))
    assert copies == [want["cow"], [[] for _ in want["cow"]]]
    kv.free(parent)
    kv.free(child)
    kv.check_integrity()


def test_block_ids_and_copies_travel_in_the_scheduler_output(case):
    kv, want = case
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add_request(Request("a", list(range(10)), SamplingParams(n=2, max_tokens=2), num_seqs=2))
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.block_ids == kv.block_ids("a") == [[0, 1, 2]] * kv.num_groups
    assert out.block_copies == [[] for _ in want["cow"]]
    sched.update(out, {"a": 5, "a#1": 6})
    out = sched.schedule()  # both samples write into the shared partial block 2: one copies it, per group
    assert out.block_copies == [[(2, 3)]] * kv.num_groups
    assert [c.block_ids for c in out.chunks] == [kv.block_ids("a"), kv.block_ids("a#1")]
    assert [c.block_ids[0] for c in out.chunks] == [[0, 1, 3], [0, 1, 2]]


def test_evict_blocks_frees_the_middle_of_a_table_and_closes_it_up():
    """KV eviction's entry point: the blocks not kept go back to the pool and the table closes up (no null
    block in it); the caller shifts the request's cache coordinates by the evicted tokens."""
    kv = KVCacheCoordinator(GROUPS["single"], BS)
    a = _req("a", list(range(21)))  # 5 full blocks and a 1-token tail
    prefill_then_decode(kv, a, 0)
    free = kv.pools[0].num_free_blocks
    assert kv.evict_blocks(a, [0, 3, 4]) == [[1, 2]]  # the ids of the blocks at 1 and 2
    assert kv.block_ids("a")[0] == [0, 3, 4, 5]
    assert kv.pools[0].num_free_blocks == free + 2 and kv.num_held_blocks("a")[0] == 4
    a.num_evicted_tokens += 2 * BS
    assert kv.evict_blocks(a, [0, 1, 2]) == [[]]  # every full block kept
    a.append_token(7)
    assert kv.allocate_slots(a, 1) is not None  # the tail block (cache position 13 of 16) takes it
    a.num_computed_tokens += 1
    assert kv.block_ids("a")[0] == [0, 3, 4, 5]
    kv.check_integrity()
    kv.free(a)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_evict_hook_sees_each_cached_block_before_its_row_is_reused(case):
    kv, _ = case
    evicted: list[tuple[bytes, int]] = []
    kv.pools[0].add_evict_listener(lambda h, block_id: evicted.append((h, block_id)))
    a = _req("a", list(range(8)) + [9])
    prefill_then_decode(kv, a, 0)
    kv.free(a)
    hashes = list(a.block_hashes)
    hog = _req("hog", [500 + i for i in range(4 * N - 1)])  # every block of the pool
    assert kv.allocate_slots(hog, hog.num_tokens) is not None
    assert sorted(evicted) == sorted(zip(hashes, [0, 1]))
    kv.free(hog)
    kv.check_integrity()
