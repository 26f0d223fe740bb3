"""Penalties, logit_bias, allowed_token_ids, bad_words and best_of (kvforge/engine/logits_processors.py).

Repetition is checked against transformers' own RepetitionPenaltyLogitsProcessor; presence and frequency
against OpenAI's documented formula; logit_bias -100 bans a token and +100 forces it through the engine.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.engine.logits_processors import apply_logits_processors
from kvforge.engine.sampler import sample

V = 50


def _logits(b: int = 3) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(0)) * 3


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(2)
    prompts, outs = [[1, 2, 3, 3], [7]], [[4, 1], [8, 0, 9, 7]]  # ragged rows; token 0 is a token too
    got = apply_logits_processors(logits.clone(), [SamplingParams(repetition_penalty=1.7),
                                                   SamplingParams(repetition_penalty=0.6)],
                                  list(zip(prompts, outs)))
    for i, pen in enumerate([1.7, 0.6]):
        ids = torch.tensor([prompts[i] + outs[i]])
        want = RepetitionPenaltyLogitsProcessor(pen)(ids, logits[i:i + 1].clone())[0]
        assert torch.allclose(got[i], want, atol=1e-6)


def test_presence_and_frequency_follow_openai_formula():
    logits = _logits(2)
    prompt, out = [5, 5, 5, 6], [1, 2, 2, 2, 9, 0]  # the prompt's tokens are not penalized
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    got = apply_logits_processors(logits.clone(), params, [(prompt, out), (prompt, out[:2])])
    want = logits[0].clone()
    counts = torch.bincount(torch.tensor(out), minlength=V).float()
    want -= counts * 0.25 + (counts > 0).float() * 0.5
    assert torch.allclose(got[0], want, atol=1e-6)
    assert torch.equal(got[1], logits[1])  # a row that asks for nothing is untouched


def test_logit_bias_allowed_and_bad_words_masks():
    logits = _logits(3)
    params = [SamplingParams(logit_bias={3: 2.5, 4: -1.0}), SamplingParams(allowed_token_ids=[10, 11]),
              SamplingParams()]
    params[2].bad_words_token_ids = [[20], [30, 31]]  # set by the engine from bad_words
    got = apply_logits_processors(logits.clone(), params, [([1], []), ([1], []), ([1], [5, 30])])
    assert got[0, 3] == logits[0, 3] + 2.5 and got[0, 4] == logits[0, 4] - 1.0 and got[0, 5] == logits[0, 5]
    assert torch.isinf(got[1]).sum() == V - 2 and got[1, 10] == logits[1, 10]
    assert got[2, 20] == float("-inf") and got[2, 31] == float("-inf") and got[2, 30] == logits[2, 30]


def test_seeded_sampling_with_penalties_is_batch_invariant():
    logits = _logits(3)
    p = SamplingParams(temperature=1.0, seed=3, presence_penalty=1.0, repetition_penalty=1.3, logit_bias={2: 5})
    hist = ([1, 2], [3, 4, 4])
    alone = sample(logits[1:2].clone(), [p], [torch.Generator().manual_seed(3)], None, [hist])
    other = SamplingParams(temperature=0.7, frequency_penalty=-1.0)
    batch = sample(logits.clone(), [other, p, other],
                   [torch.Generator().manual_seed(9), torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)],
                   None, [([0], [0, 0]), hist, ([7], [])])
    assert alone[0].token_id == batch[1].token_id


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    return LLM(model=path, log_ledger=False, num_kv_blocks=64)


def test_logit_bias_bans_and_forces_tokens(llm):
    prompt = [[5, 17, 99, 3, 8]]
    base = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=6,
                                                                                ignore_eos=True))[0].outputs[0].token_ids
    banned = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias={t: -100 for t in set(base)}))[0].outputs[0].token_ids
    assert not set(banned) & set(base)
    forced = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=1.0, seed=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100}))[0].outputs[0].token_ids
    assert forced == [42] * 6
    assert_no_leaks(llm.engine)


def test_best_of_returns_the_n_most_likely(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)[0]
    every = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        n=5, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True, logprobs=0))[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    assert_no_leaks(llm.engine)


def test_bad_words_and_allowed_token_ids_through_the_engine(llm):
    prompt = [[5, 17, 99, 3, 8]]
    allowed = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=1.0, seed=2, max_tokens=8, ignore_eos=True, allowed_token_ids=[65, 66]))[0].outputs[0]
    assert set(allowed.token_ids) <= {65, 66}
    base = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    word = llm.engine.tokenizer.decode([base.token_ids[0]])
    assert word.strip(), "the greedy first token should decode to a printable word"
    out = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]))[0].outputs[0]
    assert out.token_ids[0] != base.token_ids[0] and base.token_ids[0] not in out.token_ids
