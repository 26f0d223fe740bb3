"""cache_salt isolates tenants on every tier: two salts never share a block on device, host or disk; equal salts do.

Checked through what a user sees (`num_cached_tokens_by_tier`) and through what the tiers
hold (the disk files of the two salts are disjoint sets), with the Python API's
validation: a salt that is not a bounded, non-empty string is refused before anything is queued.
"""
from __future__ import annotations

import os

import pytest

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.kv.salt import MAX_CACHE_SALT_CHARS, combine_salts, salt_for_api_key

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 for i in range(21)]  # 5 full blocks of 4, and one token always computed
FULL = 20
WRITTEN = 6  # blocks a run leaves: the prompt's 21 tokens and 3 of the 4 generated (the last is never computed)


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, block_size=4, max_model_len=64, log_ledger=False, **kw)


def _run(llm: LLM, salt: str | None):
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, cache_salt=salt)
    return out


def _disk_files(directory: str) -> set[str]:
    return {name for _, _, files in os.walk(directory) for name in files if name.endswith(".kvb")}


def test_two_salts_never_share_a_block_on_device_host_or_disk(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama_gqa")
    disk = str(tmp_path / "kv")
    llm = _llm(path, num_kv_blocks=64, kv_offload_memory="1MiB", kv_disk_cache=disk)
    a = _run(llm, "tenant-a")
    assert _run(llm, "tenant-b").num_cached_tokens == 0  # device
    assert _run(llm, "tenant-a").num_cached_tokens_by_tier["device"] == FULL  # equal salts share
    assert _run(llm, None).num_cached_tokens == 0  # no salt is its own tenant
    llm.engine.close()  # every cached block goes to the host and disk tiers
    files_ab = _disk_files(disk)
    llm.reset_prefix_cache()  # the device forgets: what follows can only come from the tiers
    c = _run(llm, "tenant-c")
    assert c.num_cached_tokens == 0 and c.outputs[0].token_ids == a.outputs[0].token_ids
    hit = _run(llm, "tenant-a")
    assert hit.num_cached_tokens_by_tier["host"] == FULL and hit.outputs[0].token_ids == a.outputs[0].token_ids
    assert_no_leaks(llm.engine)
    llm.close()

    restarted = _llm(path, num_kv_blocks=64, kv_disk_cache=disk)  # disk only, a fresh process's view
    assert _run(restarted, "tenant-d").num_cached_tokens == 0
    assert _run(restarted, "tenant-b").num_cached_tokens_by_tier == {"device": 0, "disk": FULL}
    restarted.engine.close()
    # three salts (a, b, none) wrote their blocks before the first close: no file is shared
    assert len(files_ab) == 3 * WRITTEN
    assert len(_disk_files(disk)) == 5 * WRITTEN  # and c, d added their own


@pytest.mark.parametrize("salt, words", [
    ("", "non-empty"), (b"raw", "string"), (["a"], "string"), (3, "string"),
    ("x" * (MAX_CACHE_SALT_CHARS + 1), "at most"), ("a\ud800", "surrogate"),
])
def test_llm_generate_refuses_a_bad_salt_and_queues_nothing(tiny_model_factory, salt, words):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path, num_kv_blocks=32)
    with pytest.raises(ValueError, match="cache_salt") as info:
        llm.generate(prompt_token_ids=[PROMPT, PROMPT], sampling_params=GREEDY, cache_salt=salt)
    assert words in str(info.value)
    assert_no_leaks(llm.engine)
    assert _run(llm, "x" * MAX_CACHE_SALT_CHARS).outputs[0].token_ids  # the longest allowed salt works


def test_key_salts_are_digests_and_pairs_stay_apart():
    a, b = salt_for_api_key("key-a"), salt_for_api_key("key-b")
    assert a != b and "key-a" not in a and a == salt_for_api_key("key-a")
    assert combine_salts(None, "x") == "x" and combine_salts(a, None) == a
    pairs = {combine_salts(a, "x"), combine_salts(b, "x"), combine_salts(a, "y"), a, b, "x"}
    assert len(pairs) == 6
    assert len(combine_salts(a, "z" * MAX_CACHE_SALT_CHARS)) <= MAX_CACHE_SALT_CHARS
