"""The KV coordinator on a hybrid (local/global) model and the ledger's group split, in pure Python (no model).

A local/global model's layers form KV cache groups, each with its own pool: the
windowed group frees blocks behind the window while the request runs, the full
group keeps them; allocation is atomic across groups; a prefix hit needs the full
group's whole prefix but only the window-visible blocks of a windowed group. The
windowed group's reservation is checked against a random workload driven through
the real scheduler with the windowed pool sized to exactly that reservation.
"""
from __future__ import annotations

import random

import pytest

from conftest import prefill_then_decode
from kvforge import ledger
from kvforge.config import SchedulerConfig
from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.ledger import KVCacheFormat, KVGroup, KVShape

BS, WINDOW = 4, 8
GEMMA2_LIKE = KVShape(3, 2, 16, sliding_windows=(WINDOW, None, WINDOW))


def _kv(full: int = 32, local: int = 12) -> KVCacheCoordinator:
    return KVCacheCoordinator([KVGroup(None, (1,), full), KVGroup(WINDOW, (0, 2), local)], BS)


def test_groups_and_split():
    assert ledger.kv_cache_groups(GEMMA2_LIKE) == [KVGroup(None, (1,)), KVGroup(WINDOW, (0, 2))]
    mistral = KVShape(2, 2, 16, sliding_windows=(WINDOW, WINDOW))
    assert ledger.kv_cache_groups(mistral) == [KVGroup(WINDOW, (0, 1))]  # one table, window freeing as before
    assert ledger.kv_cache_groups(KVShape(2, 2, 16)) == [KVGroup(None, (0, 1))]
    # 4 seqs x (2 window blocks + 2) + 16 tokens / 4 = 20 blocks reserved for the local group
    assert ledger.window_block_reservation(WINDOW, BS, 4, 16) == 20
    split = ledger.split_kv_blocks(GEMMA2_LIKE, "float32", BS, 64, 4, 16)
    # 64 blocks of memory less one null block per group's pool: 63 usable, the local group keeps 20
    assert split == [KVGroup(None, (1,), 63 + 2 * (63 - 20)), KVGroup(WINDOW, (0, 2), 20)]
    assert ledger.kv_bytes_for_groups(GEMMA2_LIKE, split, BS, "float32") <= 64 * ledger.kv_bytes_per_block(
        GEMMA2_LIKE, BS, "float32")
    small = ledger.split_kv_blocks(GEMMA2_LIKE, "float32", BS, 10, 4, 16)  # the reservation exceeds the pool
    assert [g.num_blocks for g in small] == [9, 9]


def test_local_group_frees_behind_the_window_and_global_keeps_everything():
    kv = _kv()
    a = Request("a", list(range(24)), SamplingParams())
    prefill_then_decode(kv, a, 10)  # 34 tokens: the local group freed blocks ending before 33 - 8
    full, local = kv.tables("a").blocks
    null = kv.pools[1].null_block
    assert kv.pools[0].null_block not in full and len(full) == 9
    assert local[:6] == [null] * 6 and null not in local[6:]
    assert kv.num_held_blocks("a") == [9, 3]
    assert kv.block_ids("a")[1][:6] == [12] * 6  # the null block's reserved id: one past the local pool's blocks
    assert kv.pool.num_free_blocks == 32 + 12 - 12
    kv.free(a)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks == 44


def test_allocation_is_atomic_across_groups():
    kv = _kv(full=32, local=3)
    a = Request("a", list(range(20)), SamplingParams())  # 5 blocks: the local group has 3
    before = [(m.pool.num_free_blocks, dict(m.tables)) for m in kv.managers]
    assert kv.allocate_slots(a, 20) is None
    assert [(m.pool.num_free_blocks, dict(m.tables)) for m in kv.managers] == before
    assert kv.allocate_slots(a, 12) is not None  # 3 blocks fit in both
    kv.check_integrity()
    kv.free(a)


def test_prefix_hit_needs_only_the_window_blocks_of_the_local_group():
    kv = _kv()
    prompt = list(range(100, 124))  # 6 full blocks
    a = Request("a", prompt, SamplingParams())
    prefill_then_decode(kv, a, 10)
    local = kv.managers[1]
    # evict the local chain head (blocks 0-3, freed first) while blocks 4 and 5 stay cached
    assert [b.block_id for b in local.pool.free_queue.values()] == [9, 10, 11, 0, 1, 2, 3, 4, 5]
    local.pool.free_blocks(local.pool.get_new_blocks(7))
    b = Request("b", prompt + [1], SamplingParams())
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 24
    assert len(hits.blocks[0]) == 6 and hits.blocks[1][:4] == [local.null_block] * 4
    assert hits.get_block_ids()[1][4:] == [4, 5]
    assert kv.allocate_slots(b, 1, hits) == [[], []]
    b.num_computed_tokens = b.num_tokens
    kv.check_integrity()
    assert kv.num_held_blocks("b") == [7, 3]
    kv.free(b)
    # with block 5 gone too, no k has its window blocks: the hit is empty, in every group
    local.pool.free_blocks(local.pool.get_new_blocks(local.pool.num_free_blocks))
    hits, cached = kv.get_computed_blocks(Request("c", prompt + [1], SamplingParams()))
    assert cached == 0 and hits.get_block_ids() == [[], []]
    kv.free(a)
    kv.check_integrity()


def test_fork_copy_on_write_is_per_group():
    kv = _kv()
    parent = Request("p", list(range(6)), SamplingParams())
    prefill_then_decode(kv, parent, 0)
    child = Request("p#1", list(range(6)), SamplingParams())
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    copies = []
    for r in (parent, child):
        r.append_token(42)
        copies.append(kv.allocate_slots(r, 1))
    assert copies == [[[(1, 2)], [(1, 2)]], [[], []]]  # the shared partial block 1 copied once in each group
    assert kv.num_cow_copies == 2
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    assert kv.reset_prefix_cache() and kv.pool.num_cached_blocks == 0


def test_reset_is_refused_while_any_group_holds_blocks():
    kv = _kv()
    a = Request("a", list(range(9)), SamplingParams())
    prefill_then_decode(kv, a, 0)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()


def test_one_group_is_the_single_table_case():
    kv = KVCacheCoordinator([KVGroup(WINDOW, (0, 1), 16)], BS)
    assert kv.num_groups == 1 and kv.managers[0].sliding_window == WINDOW and kv.pool.num_blocks == 16
    with pytest.raises(ValueError, match="group 0"):
        KVCacheCoordinator([KVGroup(WINDOW, (0,), 4), KVGroup(None, (1,), 4)], BS)


@pytest.mark.parametrize("seed", range(4))
def test_local_group_never_needs_more_than_its_reservation(seed):
    """Random prompts, chunked prefill and a budget that leaves requests out: the local pool, sized to exactly
    the reservation, never runs short (the full pool is ample, so any preemption would be the local group's)."""
    rng = random.Random(seed)
    seqs, budget = 5, 13
    reserve = ledger.window_block_reservation(WINDOW, BS, seqs, budget)
    kv = _kv(full=10_000, local=reserve)
    sched = Scheduler(SchedulerConfig(seqs, budget, 400), kv)
    for i in range(40):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 60))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True)))
    peak = 0
    while sched.has_unfinished():
        out = sched.schedule()
        peak = max(peak, reserve - kv.pools[1].num_free_blocks)
        sched.update(out, {c.request.request_id: 1 for c in out.chunks if c.samples})
        kv.check_integrity()
    assert sched.num_preemptions == 0
    assert peak > reserve // 2  # the workload came near the bound
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_planner_counts_what_the_engine_allocates():
    fmt = KVCacheFormat.uniform("float32")
    memory = 64 * ledger.kv_bytes_per_block(GEMMA2_LIKE, BS, fmt)
    groups = ledger.split_kv_blocks(GEMMA2_LIKE, fmt, BS, 64, 4, 16)
    assert ledger.max_concurrency(memory, GEMMA2_LIKE, 40, fmt, BS, 4, 16) == groups[0].num_blocks // 10 == 14
    # one table for all layers would hold 64 // 10 = 6 such sequences in the same memory
    single = KVShape(3, 2, 16)
    assert ledger.max_concurrency(memory, single, 40, fmt, BS) == 6
