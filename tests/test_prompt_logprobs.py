"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log_softmax, fp32.

A 300-token prompt is prefilled in chunks of 64 tokens; every scored position must match the reference,
with and without its first 128 tokens already in the prefix cache (a scoring request takes no hit).
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams

VOCAB = 256  # tiny_models' byte vocabulary (+ specials below 260)


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for j in range(1, len(prompt)):
        entry = lps[j]
        want = ref[j - 1]
        assert abs(entry[prompt[j]].logprob - want[prompt[j]].item()) < 1e-4, j
        assert entry[prompt[j]].rank == int((want > want[prompt[j]]).sum()) + 1 or abs(
            entry[prompt[j]].logprob - want.topk(2).values[-1].item()) < 1e-4  # a near-tie may swap ranks
        top = want.topk(k)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert t in entry and abs(entry[t].logprob - v) < 1e-4


@pytest.mark.parametrize("cache_hit", [False, True], ids=["cold", "after-128-token-hit"])
def test_prompt_logprobs_match_transformers_in_chunks(tiny_model_factory, cache_hit):
    path, hf = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, log_ledger=False, dtype="float32", num_kv_blocks=128, block_size=16, max_num_batched_tokens=64,
              enable_prefix_caching=True)
    prompt = _prompt(300)
    if cache_hit:  # the first 128 tokens (8 blocks) become cached
        first = llm.generate(prompt_token_ids=[prompt[:128] + [7]], sampling_params=SamplingParams(max_tokens=1))
        assert first[0].outputs[0].token_ids
        probe = llm.generate(prompt_token_ids=[prompt[:200]], sampling_params=SamplingParams(max_tokens=1))
        assert probe[0].num_cached_tokens == 128  # the hit is there for a request that does not score
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.num_cached_tokens == 0  # scoring skips the hit: every scored position computes its logits
    _check(out, prompt, _reference(hf, prompt), 3)
    assert_no_leaks(llm.engine)


def test_prompt_logprobs_only_for_requests_that_ask_and_with_n(tiny_model_factory):
    path, hf = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, log_ledger=False, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    a, b = _prompt(70, 2), _prompt(45, 3)
    outs = llm.generate(prompt_token_ids=[a, b], sampling_params=[
        SamplingParams(max_tokens=3, prompt_logprobs=0, n=2, seed=1), SamplingParams(max_tokens=3)])
    assert outs[1].prompt_logprobs is None
    assert len(outs[0].outputs) == 2
    _check(outs[0], a, _reference(hf, a), 0)
    assert all(len(e) == 1 for e in outs[0].prompt_logprobs[1:])  # k=0: the prompt token's own entry only
    assert_no_leaks(llm.engine)


def test_prompt_logprobs_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_reduction_in_slices_equals_one_pass(monkeypatch):
    import kvforge.engine.prompt_logprobs as pl

    logits = torch.randn(600, 40, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 40, (600,), generator=torch.Generator().manual_seed(1))
    sliced = pl.score_rows(logits, targets, 3)  # 600 rows: three slices of at most REDUCE_ROWS
    monkeypatch.setattr(pl, "REDUCE_ROWS", 10**6)
    assert sliced == pl.score_rows(logits, targets, 3) and len(sliced) == 600
