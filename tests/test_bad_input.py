"""Bad input gets a clear error that names the field, and loses nothing."""
from __future__ import annotations

import pytest

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.engine.args import EngineArgs


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    return LLM(model=path, num_kv_blocks=64, max_model_len=100, log_ledger=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dtype": "float64"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"kv_cache_memory": -5}, "kv_cache_memory"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"kv_cache_dtype": "fp3"}, "kv_cache_dtype"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ],
)
def test_engine_args_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(model="/nonexistent/does-not-exist", log_ledger=False)


def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=greedy)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[list(range(150))], sampling_params=greedy)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=[[1, 2, 10**6]], sampling_params=greedy)
    # a good prompt batched with a bad one: nothing is queued, nothing leaks
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[1, 2, 3], list(range(150))], sampling_params=greedy)
    assert_no_leaks(llm.engine)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_leaks(llm.engine)


def test_prompt_larger_than_the_whole_cache_is_rejected_at_once(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, num_kv_blocks=2, block_size=4, log_ledger=False)
    with pytest.raises(ValueError, match="whole KV cache"):
        llm.generate(prompt_token_ids=[list(range(20))], sampling_params=SamplingParams(max_tokens=2))
    assert_no_leaks(llm.engine)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use(llm):
    engine = llm.engine
    engine.add_request(prompt_token_ids=list(range(40)), params=SamplingParams(max_tokens=5), request_id="busy")
    engine.step()
    with pytest.raises(RuntimeError, match="in use"):
        llm.reset_prefix_cache()
    engine.abort_request("busy")
    llm.reset_prefix_cache()
    assert_no_leaks(engine)
