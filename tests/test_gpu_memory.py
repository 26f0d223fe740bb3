"""KV pool sizing from GPU memory (`kvforge.engine.gpu_memory`): the arithmetic under a mocked
`torch.cuda.mem_get_info`, and when the engine uses it. Runs without a GPU."""
from __future__ import annotations

import pytest
import torch

from kvforge.config import CacheConfig
from kvforge.engine.args import EngineConfig
from kvforge.engine.gpu_memory import plan_kv_memory, uses_gpu_memory_utilization

GiB = 1 << 30


def test_kv_bytes_are_the_utilization_share_minus_what_is_in_use_and_the_activation_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GiB, 140 * GiB))
    plan = plan_kv_memory(0.9, torch.cuda.mem_get_info, lambda: 3 * GiB)
    assert plan.in_use == 40 * GiB and plan.activation_peak == 3 * GiB
    assert plan.kv_bytes == int(140 * GiB * 0.9) - 40 * GiB - 3 * GiB
    text = plan.describe()
    assert "gpu_memory_utilization 0.9" in text and "activation peak" in text


def test_a_utilization_that_leaves_nothing_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.3 leaves no memory"):
        plan_kv_memory(0.3, lambda: (90 * GiB, 140 * GiB), lambda: 0)


def test_the_option_is_validated_and_only_applies_when_the_pool_is_not_sized_otherwise():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    default = EngineConfig.create().cache_config
    assert default.kv_cache_memory == GiB  # the CPU default is unchanged
    assert uses_gpu_memory_utilization(default, cuda, tensor_parallel=False)
    assert not uses_gpu_memory_utilization(default, cpu, tensor_parallel=False)
    assert not uses_gpu_memory_utilization(default, cuda, tensor_parallel=True)
    assert not uses_gpu_memory_utilization(EngineConfig.create(kv_cache_memory="1GiB").cache_config, cuda, False)
    assert not uses_gpu_memory_utilization(EngineConfig.create(num_kv_blocks=64).cache_config, cuda, False)
    # a copy with other options keeps the default's mark
    assert uses_gpu_memory_utilization(EngineConfig.create().replace(max_num_seqs=4).cache_config, cuda, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_sizes_its_pool_from_gpu_memory_and_the_ledger_says_how(tiny_model_factory):
    from kvforge import LLM

    path, _ = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, log_ledger=False, device="cuda", gpu_memory_utilization=0.5)
    plan = llm.engine.gpu_memory
    assert plan is not None and plan.kv_bytes > 0 and plan.activation_peak > 0
    assert "gpu_memory_utilization 0.5" in llm.engine.report.render()
    assert llm.engine.report.kv_cache_bytes <= plan.kv_bytes + llm.engine.report.kv_bytes_per_block * 4
