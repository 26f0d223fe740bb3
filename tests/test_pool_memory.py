"""The KV pool is reserved at start-up and committed as blocks are written (kv/storage/pool_memory.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from kvforge.kv.storage.pool_memory import zeroed_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_pool_is_zeros_and_costs_rss_only_where_written():
    before = _rss_mib()
    pool = zeroed_pool((256, 16, 8, 64), torch.bfloat16)  # 4 MiB
    big = zeroed_pool((4096, 16, 8, 128), torch.bfloat16)  # 128 MiB
    assert pool.shape == (256, 16, 8, 64) and pool.dtype == torch.bfloat16 and big.is_contiguous()
    assert float(big[::97].abs().sum()) == 0.0  # reading untouched blocks commits nothing
    assert _rss_mib() - before < 32, "a 132 MiB pool should not be resident before it is written"
    big[:64] = 1.0  # 64 blocks = 2 MiB written
    grown = _rss_mib() - before
    assert 1.5 < grown < 32, grown
    assert float(big[:64].float().mean()) == 1.0 and float(big[64:].float().abs().sum()) == 0.0


def test_small_and_device_pools_are_plain_zeros():
    small = zeroed_pool((4, 16, 2, 8), torch.float32)
    assert torch.equal(small, torch.zeros(4, 16, 2, 8))
    small += 1  # writable
    assert float(small.sum()) == 4 * 16 * 2 * 8


def test_an_engine_pool_of_a_gibibyte_is_not_resident_at_start(tiny_model_factory):
    from kvforge import LLM, SamplingParams

    path, _ = tiny_model_factory("llama_gqa")
    before = _rss_mib()
    llm = LLM(model=path, log_ledger=False, kv_cache_memory="1GiB")
    assert _rss_mib() - before < 256
    out = llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
