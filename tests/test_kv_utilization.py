"""KV utilization (tokens stored / slots allocated) and the contiguous reservation mode (issue 18).

Hand-computed values on scripted schedules, pure and through the engine; contiguous and
paged modes must give identical outputs and leak nothing.
"""
from __future__ import annotations

import pytest

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.engine.request import Request
from kvforge.kv.contiguous import ContiguousKVCacheCoordinator
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.kv.utilization import KVUtilizationStats, measure, measure_request
from kvforge.ledger import KVGroup


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams())


def _kv(num_blocks: int, caching: bool = True, max_model_len: int | None = None) -> KVCacheCoordinator:
    """One full-attention group of `num_blocks` blocks of 4 tokens; contiguous when max_model_len is given."""
    groups = [KVGroup(None, (0,), num_blocks)]
    if max_model_len is None:
        return KVCacheCoordinator(groups, 4, caching)
    return ContiguousKVCacheCoordinator(groups, 4, caching, max_model_len)


@pytest.mark.parametrize("contiguous", [False, True], ids=["paged", "contiguous"])
def test_utilization_on_scripted_schedule(contiguous):
    kv = _kv(32, caching=False, max_model_len=16 if contiguous else None)
    a, b = _req("a", 5), _req("b", 10)
    assert kv.allocate_slots(a, 5) is not None and kv.allocate_slots(b, 10) is not None
    a.num_computed_tokens, b.num_computed_tokens = 5, 10
    # paged: a holds 2 blocks (8 slots), b 3 blocks (12); contiguous: 4 blocks (16 slots) each
    slots = 32 if contiguous else 20
    u = measure(kv, {"a": 5, "b": 10})
    assert (u.tokens_stored, u.slots_allocated, u.reserved_unused_slots) == (15, slots, slots - 15)
    assert u.utilization == pytest.approx(15 / slots)
    assert measure_request(kv, "b", 10).slots_allocated == (16 if contiguous else 12)
    # one decode step each: a writes its 6th token (same block), b its 11th (same block)
    for r in (a, b):
        r.append_token(7)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert measure(kv, {"a": 6, "b": 11}).slots_allocated == slots
    assert measure(kv, {"a": 6, "b": 11}).tokens_stored == 17
    # b grows into a 4th block: paged allocates it now, contiguous reserved it at admission
    for _ in range(2):
        b.append_token(7)
        assert kv.allocate_slots(b, 1) is not None
        b.num_computed_tokens += 1
    u = measure(kv, {"a": 6, "b": 13})
    assert (u.tokens_stored, u.slots_allocated) == (19, slots + (0 if contiguous else 4))
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 32
    kv.check_integrity()


def test_contiguous_refuses_a_pool_smaller_than_one_reservation():
    with pytest.raises(ValueError, match="max_model_len"):
        _kv(3, max_model_len=16)


def test_contiguous_refuses_windowed_groups():
    with pytest.raises(ValueError, match="one full-attention"):
        ContiguousKVCacheCoordinator([KVGroup(8, (0,), 16)], 4, True, 16)


def test_contiguous_fork_shares_the_prompt_only():
    kv = _kv(16, max_model_len=16)
    parent, child = _req("p", 6), _req("c", 6)
    assert kv.allocate_slots(parent, 6) is not None
    assert kv.num_held_blocks("p") == [4]
    kv.fork(parent, child)
    assert kv.block_ids("c") == [kv.block_ids("p")[0][:2]]  # the prompt's two blocks, not the reservation
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 16
    kv.check_integrity()


def test_shared_blocks_count_once():
    kv = _kv(16)
    parent = _req("p", 6)
    assert kv.allocate_slots(parent, 6) is not None
    child = _req("c", 6)
    kv.fork(parent, child)
    u = measure(kv, {"p": 6, "c": 6})
    assert (u.tokens_stored, u.slots_allocated) == (6, 8)


def test_stats_average_and_peak():
    kv = _kv(16, caching=False)
    stats = KVUtilizationStats()
    a = _req("a", 3)
    kv.allocate_slots(a, 3)
    stats.observe(kv, {"a": 3}, {"a": "a"})  # 3 / 4
    a.num_computed_tokens = 3
    a.append_token(7)
    kv.allocate_slots(a, 1)
    a.num_computed_tokens = 4
    a.append_token(7)
    kv.allocate_slots(a, 1)
    stats.observe(kv, {"a": 5}, {"a": "a"})  # 5 / 8
    assert stats.mean_utilization == pytest.approx(8 / 12)
    assert stats.peak_running_seqs == 1 and stats.peak_slots_allocated == 8
    assert stats.pop_request("a").tokens_stored == 5 and stats.pop_request("a").slots_allocated == 0


def _llm(path: str, mode: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 24)
    return LLM(model=path, log_ledger=False, block_size=4, max_model_len=16, kv_allocation=mode, **kw)


@pytest.mark.parametrize("mode, slots, mean", [("paged", 8, 18 / 24), ("contiguous", 16, 18 / 48)])
def test_engine_utilization_hand_computed(tiny_model_factory, mode, slots, mean):
    """Prompt of 5, 3 greedy tokens, blocks of 4: steps store 5, 6, 7 tokens in 2 blocks (paged) or 4 (contiguous)."""
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path, mode)
    (out,) = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9]],
                          sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    m = out.metrics
    assert (m.kv_tokens_stored, m.kv_slots_allocated, m.kv_reserved_unused_slots) == (7, slots, slots - 7)
    assert m.kv_utilization == pytest.approx(7 / slots)
    usage = llm.engine.kv_usage
    assert usage.num_steps == 3 and usage.mean_utilization == pytest.approx(mean)
    assert usage.last.slots_allocated == slots  # sampled before the finished request freed its blocks
    assert_no_leaks(llm.engine)


PROMPTS = [[(3 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 9, 5, 12, 7, 2])]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=3, n=2),
], ids=["greedy", "seeded-n2"])
@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 5}], ids=["batch", "chunked"])
def test_contiguous_and_paged_give_identical_outputs(tiny_model_factory, params, engine_kwargs):
    path, _ = tiny_model_factory("llama_gqa")
    outs = {}
    for mode in ("paged", "contiguous"):
        llm = _llm(path, mode, **engine_kwargs)
        res = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        outs[mode] = [[c.token_ids for c in o.outputs] for o in res]
        assert_no_leaks(llm.engine)
        if mode == "contiguous":  # 24 blocks hold 6 reservations of 4 blocks: never more at once
            assert llm.engine.kv_usage.peak_slots_allocated <= 24 * 4
    assert outs["paged"] == outs["contiguous"]


def test_contiguous_bad_values(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    with pytest.raises(ValueError, match="kv_allocation"):
        LLM(model=path, log_ledger=False, kv_allocation="naive")
    with pytest.raises(ValueError, match="reserves"):
        _llm(path, "contiguous", num_kv_blocks=3)


def test_closed_form_fill_equals_the_block_walk():
    """`measure` and `measure_request` skip the per-block walk when tables share no block and hold no null
    block; on random tables (plain, shared, windowed) they give what the walk gives."""
    import random
    from types import SimpleNamespace

    from kvforge.kv.utilization import _table_fill

    def walk(tables: dict[str, list[int]], stored: dict[str, int], null: int, bs: int) -> tuple[int, int]:
        fill: dict[int, int] = {}
        for rid, table in tables.items():
            for block, n in _table_fill(table, null, stored[rid], bs):
                fill[block] = max(fill.get(block, 0), n)
        return sum(fill.values()), len(fill) * bs

    rng = random.Random(0)
    for case in range(300):
        bs, null = rng.choice((1, 4, 16)), 0
        tables, stored, next_id = {}, {}, 1
        for r in range(rng.randint(1, 6)):
            blocks = [next_id + i for i in range(rng.randint(0, 8))]
            next_id += len(blocks)
            if tables and case % 3 == 1:  # a shared prefix
                blocks = list(tables["r0"][: rng.randint(0, len(tables["r0"]))]) + blocks
            if case % 3 == 2:  # the first blocks left a sliding window: null placeholders
                gone = rng.randint(0, len(blocks))
                blocks = [null] * gone + blocks[gone:]
            tables[f"r{r}"] = blocks
            stored[f"r{r}"] = rng.randint(0, len(blocks) * bs + 3)
        kv = SimpleNamespace(block_size=bs, pools=[SimpleNamespace(null_block=SimpleNamespace(block_id=null))],
                             block_ids=lambda rid, t=tables: [t[rid]])
        u = measure(kv, stored)  # type: ignore[arg-type]
        assert (u.tokens_stored, u.slots_allocated) == walk(tables, stored, null, bs), case
        for rid in tables:
            v = measure_request(kv, rid, stored[rid])  # type: ignore[arg-type]
            own = [(b, n) for b, n in _table_fill(tables[rid], null, stored[rid], bs)]
            assert (v.tokens_stored, v.slots_allocated) == (sum(n for _, n in own), len(own) * bs), (case, rid)
