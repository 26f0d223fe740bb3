"""The KV-affinity router against a reference function, on scripted block-hash event streams.

The reference is written from the policy's statement (longest leading run of held block hashes,
unless that replica's load exceeds the least loaded one by more than max_load_diff AND by more than
max_load_ratio times; otherwise, or with no prefix anywhere, the least loaded), independently of
the router's bookkeeping. Hashes come from kvforge's own block hash chain, salt included.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from kvforge.distributed.router import (
    AFFINITY, LOAD_FALLBACK, NO_PREFIX, BlockIndexDiff, KVAffinityRouter, RouterConfig,
)
from kvforge.kv.hashing import extend_block_hashes

BS = 4


def chain(tokens, salt=None):
    return extend_block_hashes([], tokens, BS, (salt,) if salt else ())


def reference(held: dict, loads: dict, hashes: list, ratio: float, diff: float):
    """(replica, kind) by the documented policy; ties: most blocks, then least load, then listing order."""
    order = list(held)

    def match(r):
        n = 0
        while n < len(hashes) and hashes[n] in held[r]:
            n += 1
        return n

    least = min(order, key=lambda r: (loads[r], order.index(r)))
    best = min(order, key=lambda r: (-match(r), loads[r], order.index(r)))
    if match(best) == 0:
        return least, NO_PREFIX
    if loads[best] - loads[least] > diff and loads[best] > ratio * loads[least]:
        return least, LOAD_FALLBACK
    return best, AFFINITY


def router(**cfg):
    r = KVAffinityRouter(RouterConfig(pending_ttl=0.0, **cfg), clock=lambda: 0.0)
    for name in ("a", "b", "c"):
        r.add_replica(name)
    return r


def test_longest_prefix_wins():
    r = router()
    p = list(range(40))
    h = chain(p)
    r.on_events("a", stored=h[:2])
    r.on_events("b", stored=h[:6])
    r.on_events("c", stored=h[3:])  # holds later blocks but not the first: no prefix at all
    d = r.choose(h)
    assert (d.replica, d.kind, d.matched_blocks) == ("b", AFFINITY, 6)


def test_load_guard_needs_both_thresholds():
    r = router(max_load_ratio=1.5, max_load_diff=4)
    h = chain(list(range(16)))
    r.on_events("a", stored=h)
    r.on_load("a", running=6, waiting=0, kv_usage=0.0)
    r.on_load("b", running=3, waiting=0, kv_usage=0.0)
    r.on_load("c", running=2, waiting=0, kv_usage=0.0)
    assert r.choose(h).kind == AFFINITY  # 6 - 2 = 4 is not more than 4
    r.on_load("a", running=4, waiting=3, kv_usage=0.0)
    d = r.choose(h)
    assert (d.replica, d.kind) == ("c", LOAD_FALLBACK)  # 7 - 2 > 4 and 7 > 1.5 x 2
    r.on_load("c", running=5, waiting=0, kv_usage=0.0)
    r.on_load("b", running=5, waiting=0, kv_usage=0.0)
    assert r.choose(h).kind == AFFINITY  # 7 vs 5: ratio 1.4, diff 2


def test_cache_salt_isolates_tenants():
    r = router()
    p = list(range(32))
    r.on_events("a", stored=chain(p, salt="tenant-1"))
    assert r.choose(chain(p, salt="tenant-1")).replica == "a"
    d = r.choose(chain(p, salt="tenant-2"))
    assert d.kind == NO_PREFIX and d.matched_blocks == 0
    assert r.choose(chain(p)).kind == NO_PREFIX  # unsalted differs from every salted chain


def test_evicted_block_is_no_longer_counted():
    r = router()
    h = chain(list(range(32)))
    r.on_events("a", stored=h)
    r.on_events("b", stored=h[:4])
    assert r.choose(h).replica == "a"
    r.on_events("a", evicted=h[2:3])  # a hole at block 2: a now holds a 2-block prefix
    d = r.choose(h)
    assert (d.replica, d.matched_blocks) == ("b", 4)


def test_pending_blocks_steer_a_burst_until_they_expire():
    now = [0.0]
    r = KVAffinityRouter(RouterConfig(pending_ttl=10.0, max_load_diff=100), clock=lambda: now[0])
    r.add_replica("a"), r.add_replica("b")
    h = chain(list(range(24)))
    first = r.route(h)
    assert first.kind == NO_PREFIX
    second = r.route(h)  # nothing reported yet, but the first request's prompt is on its way there
    assert (second.replica, second.kind) == (first.replica, AFFINITY)
    now[0] = 11.0
    r.finished(first.replica), r.finished(first.replica)
    assert r.choose(h).kind == NO_PREFIX


def test_dead_replica_is_routed_around():
    r = router()
    h = chain(list(range(16)))
    r.on_events("b", stored=h)
    assert r.choose(h).replica == "b"
    assert r.choose(h, exclude=["b"]).kind == NO_PREFIX
    r.remove_replica("b")
    assert r.choose(h).replica in ("a", "c")
    for name in ("a", "c"):
        r.remove_replica(name)
    with pytest.raises(LookupError):
        r.choose(h)


def test_block_index_diff_produces_events():
    d = BlockIndexDiff()
    stored, evicted = d.diff([b"x", b"y"])
    assert set(stored) == {b"x", b"y"} and evicted == []
    stored, evicted = d.diff([b"y", b"z"])
    assert stored == [b"z"] and evicted == [b"x"]


def test_bad_config_is_rejected():
    for bad in (dict(max_load_ratio=0.5), dict(max_load_diff=-1), dict(pending_ttl=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterConfig(**bad)


PROMPTS = [[p] * 3 + list(range(13 * p, 13 * p + 29)) for p in range(5)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["store", "evict", "load", "query"]),
                          st.integers(0, 4), st.integers(0, 7), st.integers(0, 9), st.booleans()), max_size=40),
       st.sampled_from([(1.5, 4.0), (1.0, 0.0), (2.0, 1.0)]))
def test_router_equals_reference_on_scripted_streams(events, thresholds):
    ratio, diff = thresholds
    r = router(max_load_ratio=ratio, max_load_diff=diff)
    held = {name: set() for name in "abc"}
    loads = {name: 0.0 for name in "abc"}
    rng = random.Random(len(events))
    for replica, kind, prompt, nblocks, load, salted in events:
        h = chain(PROMPTS[prompt], salt="s" if salted else None)
        if kind == "store":
            r.on_events(replica, stored=h[:nblocks])
            held[replica] |= set(h[:nblocks])
        elif kind == "evict":
            victims = rng.sample(h, min(len(h), nblocks % 3))
            r.on_events(replica, evicted=victims)
            held[replica] -= set(victims)
        elif kind == "load":
            r.on_load(replica, running=load, waiting=nblocks % 2, kv_usage=0.0)
            loads[replica] = float(load + nblocks % 2)
        d = r.choose(h)
        assert (d.replica, d.kind) == reference(held, loads, h, ratio, diff)
