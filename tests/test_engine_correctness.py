"""kvforge vs transformers on the same weights: greedy tokens equal, logits close (fp32).

Every scheduling path must give the same tokens: one big batch, chunked prefill
under a tiny token budget, a tiny cache that forces preemption, and requests
that arrive while others decode.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from tiny_models import hf_greedy

PROMPTS = [[5, 17, 99, 3, 8, 200, 45], list(range(10, 60)), [7], [i % 250 for i in range(31, 31 + 96)]]
NEW_TOKENS = 32
# The Llama-family layouts (MHA, GQA, MQA, biases, rope scaling, untied heads); MLA, sliding-window and
# Gemma families have their own test files.
LLAMA_FAMILIES = ["llama_gqa", "llama_mha", "llama_mqa", "llama3_rope", "llama_untied", "qwen2_bias", "mistral",
                  "llama_d64"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _reference(hf_model) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("dtype", "float32")  # the transformers parity is in fp32 (auto: bf16 on bf16 CPUs)
    return LLM(model=path, log_ledger=False, **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "torch"])
@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_greedy_batch_and_logits_match_transformers(tiny_model_factory, family, backend):
    path, hf = tiny_model_factory(family)
    llm = _llm(path, attention_backend=backend)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _reference(hf)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    logits = llm.engine.prompt_logits(PROMPTS[3])
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[3]])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 17, "block_size": 8}, id="tiny-cache-preemption"),
        pytest.param({"max_num_seqs": 2, "max_num_batched_tokens": 16}, id="few-seqs"),
        pytest.param({"block_size": 1, "num_kv_blocks": 129}, id="block-size-1"),  # 128 usable + the null block
    ],
)
@pytest.mark.parametrize("family", ["llama_gqa", "llama_d64"])
def test_scheduling_paths_do_not_change_outputs(tiny_model_factory, engine_kwargs, family):
    path, hf = tiny_model_factory(family)
    llm = _llm(path, **engine_kwargs)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _reference(hf)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert_no_leaks(llm.engine)


def test_requests_arriving_while_others_decode(tiny_model_factory):
    path, hf = tiny_model_factory("llama_gqa")
    engine = _llm(path, max_num_batched_tokens=20).engine
    expected = dict(zip(map(str, range(len(PROMPTS))), _reference(hf)))
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 5 == 0:  # a new request joins every few steps
            i, prompt = pending.pop(0)
            engine.add_request(prompt_token_ids=prompt, params=GREEDY, request_id=str(i))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert finished == expected
    assert_no_leaks(engine)


def test_seeded_sampling_is_batch_independent(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(prompt_token_ids=[PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         sampling_params=[unseeded, params, unseeded])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=other_seed)[0].outputs[0].token_ids != alone
    assert_no_leaks(llm.engine)


def test_max_tokens_eos_and_stop_token_ids(tiny_model_factory):
    path, hf = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    ref = _reference(hf)[1]
    stop_at = ref[5]
    out = llm.generate(prompt_token_ids=[PROMPTS[1]],
                       sampling_params=SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_at]))[0]
    first = ref.index(stop_at)
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    out = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.outputs[0].token_ids == ref[:3] and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm.engine)


def test_generation_stops_at_max_model_len(tiny_model_factory):
    path, hf = tiny_model_factory("llama_gqa")
    llm = _llm(path, max_model_len=60)
    out = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=GREEDY)[0]
    assert len(PROMPTS[1]) + len(out.outputs[0].token_ids) == 60
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == _reference(hf)[1][:10]
    assert_no_leaks(llm.engine)
