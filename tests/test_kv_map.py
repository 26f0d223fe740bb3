"""The live KV block map (`kv/block_map.py`, `engine/kv_map.py`): the snapshot is the coordinator's state.

Every scripted schedule below steps a real engine and, after each step, checks the snapshot
against what the block tables imply, derived independently of the pool's own bookkeeping:
a block's reference count is the number of tables that hold it, a block no table holds is
free (cached if its hash is still indexed), and the cached free blocks appear in LRU order.
The events of each schedule (hits, copy-on-write, preemption, eviction, tier loads) are
checked against the counters the engine keeps anyway.
"""
from __future__ import annotations

from collections import Counter

import pytest

from kvforge.engine.args import EngineArgs
from kvforge.engine.engine import LLMEngine
from kvforge.engine.sampling_params import SamplingParams
from kvforge.kv.block_map import NULL_ID, StepWrites
from kvforge.kv.events import KVEventLog

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(path: str, **kw) -> LLMEngine:
    args = dict(num_kv_blocks=64, max_model_len=256, block_size=4, log_ledger=False)
    args.update(kw)
    return LLMEngine(EngineArgs(model=path, **args))


def check_snapshot(engine: LLMEngine) -> dict:
    """The snapshot after a step, asserted against the tables; returns it."""
    snap = engine.kv_map.snapshot(engine)
    kv = engine.kv
    reqs = {r.request_id: r for r in list(engine.scheduler.running) + list(engine.scheduler.waiting)}
    assert {r["id"] for r in snap["requests"]} == set(reqs)
    by_id = {r["id"]: r for r in snap["requests"]}
    for rid in reqs:
        expected = [[NULL_ID if b == pool.null_block.block_id else b for b in ids]
                    for ids, pool in zip(kv.block_ids(rid), kv.pools)]
        assert by_id[rid]["tables"] == expected, rid
    for g, (group, pool) in enumerate(zip(snap["groups"], kv.pools)):
        assert len(group["states"]) == pool.num_blocks
        held = Counter(b for r in snap["requests"] for b in r["tables"][g] if b != NULL_ID)
        filled = {b for r in snap["requests"] for b in
                  r["tables"][g][: -(-(r["num_computed"] - reqs[r["id"]].num_evicted_tokens) // kv.block_size)]}
        for block_id, ch in enumerate(group["states"]):
            n = held.get(block_id, 0)
            if n == 0:
                assert ch in ".c", (g, block_id, ch)
                assert (ch == "c") == (pool.blocks[block_id].block_hash is not None)
            elif ch != "w":
                assert ch == ("r" if block_id not in filled else "u" if n == 1 else "s"), (g, block_id, ch)
        assert group["refs"] == {str(b): n for b, n in held.items() if n > 1}
        assert group["lru"] == [b for b in pool.free_queue if pool.blocks[b].block_hash is not None]
        assert sum(group["counts"].values()) == pool.num_blocks
        assert group["counts"]["free"] + group["counts"]["cached"] == pool.num_free_blocks
    return snap


def run_checked(engine: LLMEngine) -> list[dict]:
    """Step to the end, checking every snapshot; returns them."""
    snaps = []
    while engine.has_unfinished_requests():
        engine.step()
        snaps.append(check_snapshot(engine))
    return snaps


def events(engine: LLMEngine, kind: str) -> list[dict]:
    return [e for e in engine.kv_map.events.since(0) if e["kind"] == kind]


@pytest.fixture(scope="module")
def gqa(tiny_model_factory):
    return tiny_model_factory("llama_gqa")[0]


def test_shared_prefix_shows_ref_counts_and_hit_lengths(gqa):
    engine = _engine(gqa)
    prompt = list(range(10, 30))  # 20 tokens: 4 full blocks of 4 hit, the last token recomputed
    engine.add_request(None, GREEDY, prompt, request_id="a")
    engine.step()
    engine.add_request(None, GREEDY, prompt, request_id="b")
    engine.step()
    snap = check_snapshot(engine)
    assert max(int(n) for n in snap["groups"][0]["refs"].values()) == 2
    shared = {int(b) for b in snap["groups"][0]["refs"]}
    tables = {r["id"]: r["tables"][0] for r in snap["requests"]}
    assert shared <= set(tables["a"]) & set(tables["b"])
    admits = {e["request"]: e for e in events(engine, "admit")}
    assert admits["a"]["cached_tokens"] == 0 and admits["b"]["cached_tokens"] == 16
    snaps = run_checked(engine)
    final = check_snapshot(engine)
    assert final["groups"][0]["counts"]["cached"] == engine.kv.pool.num_cached_blocks
    assert [h[0] for h in final["history"]] == list(range(1, final["step"] + 1))  # one gauge row a step
    assert all(0 <= v <= 1 for h in final["history"] for v in h[1:4])
    assert final["history"][-1][2] == engine.kv.stats.hit_rate
    assert len(snaps) == final["step"] - 2
    assert not final["requests"]


def test_written_blocks_are_the_last_steps_chunks(gqa):
    engine = _engine(gqa, max_num_batched_tokens=8)  # a 20-token prompt in chunks of 8
    engine.add_request(None, GREEDY, list(range(40, 60)), request_id="a")
    engine.step()
    snap = check_snapshot(engine)
    table = snap["requests"][0]["tables"][0]
    assert [i for i, ch in enumerate(snap["groups"][0]["states"]) if ch == "w"] == sorted(table[:2])
    engine.step()
    snap = check_snapshot(engine)
    table = snap["requests"][0]["tables"][0]  # blocks are allocated as the chunks need them
    assert len(table) == 4
    assert sorted(i for i, ch in enumerate(snap["groups"][0]["states"]) if ch == "w") == sorted(table[2:4])


def test_copy_on_write_of_forked_samples(gqa):
    engine = _engine(gqa)
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=6, ignore_eos=True)
    engine.add_request(None, params, list(range(10, 19)), request_id="fork")  # 9 tokens: a shared partial block
    run_checked(engine)
    cows = events(engine, "cow")
    assert len(cows) == engine.kv.num_cow_copies >= 1
    assert all(c["src"] != c["dst"] for c in cows)


def test_preemption_events_name_recompute(gqa):
    engine = _engine(gqa, num_kv_blocks=12, max_num_seqs=4)
    for i in range(4):
        engine.add_request(None, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           list(range(20 + i, 32 + i)), request_id=f"r{i}")
    run_checked(engine)
    pre = events(engine, "preempt")
    assert len(pre) == engine.scheduler.num_preemptions >= 1
    assert {e["mode"] for e in pre} == {"recompute"}
    readmitted = [e for e in events(engine, "admit") if e["recompute"]]
    assert len(readmitted) == len(pre)


def test_swap_preemption_events_and_snapshot(gqa):
    """preemption_mode="swap" with a host tier: each preempted request's blocks go to the host tier; the
    event says swap, the snapshot of that step shows it waiting with no blocks and the host tier holding
    them, and its re-admission is a recompute whose prefix comes back from the host tier."""
    engine = _engine(gqa, num_kv_blocks=12, max_num_seqs=4, kv_offload_memory="1MiB", preemption_mode="swap")
    for i in range(4):
        engine.add_request(None, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           list(range(20 + i, 32 + i)), request_id=f"r{i}")
    swaps: list[tuple[str, int]] = []  # (request, step); a request may be swapped out more than once
    while engine.has_unfinished_requests():
        engine.step()
        snap = check_snapshot(engine)
        for e in events(engine, "preempt"):
            if e["step"] != snap["step"]:
                continue
            (entry,) = [r for r in snap["requests"] if r["id"] == e["request"]]
            assert entry["status"] == "waiting" and entry["tables"] == [[]] and entry["num_computed"] == 0
            if e["mode"] == "swap":
                swaps.append((e["request"], e["step"]))
                host = {t["name"]: t for t in snap["tiers"]}["host"]
                assert host["blocks_stored"] > 0 and host["used_bytes"] > 0  # the swapped blocks are there now
    pre = events(engine, "preempt")
    assert len(pre) == engine.scheduler.num_preemptions
    assert len(swaps) == sum(e["mode"] == "swap" for e in pre) == engine.scheduler.num_swaps >= 1
    assert engine.tier_stats()["host"]["swapped_out_blocks"] > 0
    readmits = [e for e in events(engine, "admit") if any(e["request"] == r and e["step"] > s for r, s in swaps)]
    assert readmits and all(e["recompute"] for e in readmits)
    assert all(sum(e["by_tier"].values()) == e["cached_tokens"] <= e["tokens"] for e in readmits)
    host_tokens = sum(e["by_tier"]["host"] for e in readmits)  # this admission's split, not the first one's
    assert host_tokens == engine.tier_stats()["host"]["blocks_loaded"] * engine.kv.block_size > 0
    assert events(engine, "tier_load")


@pytest.mark.parametrize("cap", [None, 2], ids=["all-ids", "cut-to-2"])
def test_eviction_events_name_the_blocks_the_coordinator_dropped(gqa, monkeypatch, cap):
    """Each `evict` event lists the ids the coordinator freed from the table, derived here from the table
    before and after each `evict_blocks` call; with a cap, a bigger drop lists its first ids and the count."""
    if cap is not None:
        monkeypatch.setattr("kvforge.engine.kv_map.MAX_EVENT_BLOCK_IDS", cap)
    engine = _engine(gqa, kv_eviction="streaming", kv_budget=16, kv_sink_tokens=4)
    kv, drops = engine.kv, []
    real = kv.evict_blocks

    def spy(req, keep):
        before = kv.block_ids(req.request_id)
        out = real(req, keep)
        after = kv.block_ids(req.request_id)
        gone = [[b for b in old if b not in set(new)] for old, new in zip(before, after)]
        assert out == gone  # the coordinator reports what left the table
        if any(gone):
            drops.append((engine.kv_map.step, req.request_id, gone))
        return out

    monkeypatch.setattr(kv, "evict_blocks", spy)
    engine.add_request(None, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), list(range(10, 50)),
                       request_id="long")
    run_checked(engine)
    ev = events(engine, "evict")
    assert len(drops) >= 2 and len(drops[0][2][0]) > 2  # the prompt's cut (several blocks), then decode's
    limit = cap or 64
    assert [(e["step"], e["request"], e["block_ids"]) for e in ev] == [
        (step, rid, [ids[:limit] for ids in gone]) for step, rid, gone in drops]
    assert [e["blocks"] for e in ev] == [len(gone[0]) for _, _, gone in drops]
    assert sum(e["blocks"] for e in ev) == engine.counters.num_evicted_blocks
    assert {e["policy"] for e in ev} == {"streaming"}
    if cap is not None:
        assert any(e["blocks"] > len(e["block_ids"][0]) == cap for e in ev), "the prompt's cut is over the cap"


def test_tier_loads_and_stores_appear(gqa):
    engine = _engine(gqa, num_kv_blocks=10, kv_offload_memory="1MiB")
    first = list(range(10, 30))
    engine.add_request(None, GREEDY, first, request_id="a")
    run_checked(engine)
    for i in range(3):  # other prompts reclaim a's cached blocks: they go to the host tier
        engine.add_request(None, GREEDY, list(range(100 + 20 * i, 120 + 20 * i)), request_id=f"x{i}")
        run_checked(engine)
    assert events(engine, "reclaim") and events(engine, "tier_store")
    engine.add_request(None, GREEDY, first, request_id="again")
    run_checked(engine)
    loads = events(engine, "tier_load")
    assert loads and sum(len(e["blocks"]) for e in loads) == engine.tier_stats()["host"]["blocks_loaded"]
    host = check_snapshot(engine)["tiers"][0]
    assert host["name"] == "host" and 0 < host["used_bytes"] <= host["capacity_bytes"]


def test_hybrid_model_has_a_map_per_group_with_null_blocks(tiny_model_factory):
    engine = _engine(tiny_model_factory("gemma2")[0], max_num_batched_tokens=8)  # window 8: local blocks go to null
    engine.add_request(None, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), list(range(10, 40)),
                       request_id="h")
    snaps = run_checked(engine)
    assert snaps[0]["num_groups"] == 2 and snaps[0]["groups"][1]["window"] is not None
    assert any(NULL_ID in r["tables"][1] for s in snaps for r in s["requests"])
    assert all(NULL_ID not in r["tables"][0] for s in snaps for r in s["requests"])


def test_a_contiguous_reservation_shows_as_reserved_blocks(gqa):
    engine = _engine(gqa, max_model_len=64, kv_allocation="contiguous")  # 16 blocks reserved per sequence
    engine.add_request(None, GREEDY, list(range(10, 20)), request_id="a")
    engine.step()
    counts = check_snapshot(engine)["groups"][0]["counts"]
    assert counts["written"] == 3 and counts["reserved"] == 13  # 10 prompt tokens + nothing in the other 13


def test_gauges_price_contiguous_waste(gqa):
    engine = _engine(gqa, max_model_len=128)
    engine.add_request(None, GREEDY, list(range(10, 20)), request_id="a")
    engine.step()
    g = check_snapshot(engine)["gauges"]
    assert g["contiguous_slots"] == 128 and g["tokens_stored"] == 10
    assert g["contiguous_waste"] == pytest.approx(1 - 10 / 128)
    assert g["slots_allocated"] == 12 and g["paged_waste"] == pytest.approx(2 / 12)


def test_step_writes_follow_eviction_shift():
    writes = StepWrites.from_chunks([(12, 4, [[7, 8, 9, 10]])], 4, 1, [99], evicted={0: 8})
    assert writes.blocks == [{8}]  # token 12, 8 tokens compacted away: table index 1


def test_event_log_is_bounded_and_read_by_sequence():
    log = KVEventLog(capacity=3)
    for i in range(5):
        log.record("reclaim", i, blocks=i)
    assert [e["seq"] for e in log.since(0)] == [2, 3, 4]
    assert [e["seq"] for e in log.since(4)] == [4]
    with pytest.raises(ValueError, match="unknown KV event kind"):
        log.record("nonsense", 0)


def test_kvforge_top_lists_the_dropped_block_ids():
    from kvforge.server.kv_top import _event_text

    e = {"kind": "evict", "request": "r", "policy": "streaming", "blocks": 5, "block_ids": [[3, 4]]}
    assert _event_text(e) == "r: streaming dropped 5 blocks (3, 4, +3 more)"
    assert _event_text({**e, "blocks": 2}) == "r: streaming dropped 2 blocks (3, 4)"
