"""Quantized KV caches inside the engine, on tiny random-weight models.

Stated tolerances (fp8 e4m3, per-token scales, vs the fp32 cache, 2-layer tiny model):
relative L2 error of the prompt logits < 0.10, mean next-token KL < 0.01, and at
least 85% of greedy steps pick the same token (teacher-forced along the
unquantized greedy path, so one early flip cannot void the remaining steps).
A random tiny model's top-2 logit margin is ~0.3 against a logit spread of ~1.2,
so these bounds are loose for a trained model (see `kvforge eval kv-quant`),
and tight enough to catch a wrong scale, a lost scale on copy, or a clipped value.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv.storage.quantized import QuantizedKVCache
from kvforge.ledger import KVCacheFormat, kv_bytes_per_block

GEN = 16
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(0, 256, (n,), generator=_g).tolist() for n in (9, 23, 40, 70)]
LONG = torch.randint(0, 256, (200,), generator=_g).tolist()


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")  # the transformers parity is in fp32 (auto: bf16 on bf16 CPUs)
    kwargs.setdefault("num_kv_blocks", 96)
    return LLM(model=path, log_ledger=False, **kwargs)


def _greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    ref = _llm(path)
    return path, _greedy(ref), ref.engine.prompt_logits(LONG)


def test_auto_is_bit_identical_to_the_unquantized_engine(tiny):
    path, ref_tokens, ref_logits = tiny
    for kwargs in ({"kv_cache_dtype": "auto"}, {"k_cache_dtype": "auto", "v_cache_dtype": "auto", "kv_cache_scale": "channel"}):
        llm = _llm(path, **kwargs)
        assert all(isinstance(c, DenseKVCache) for c in llm.engine.runner.caches)
        assert _greedy(llm) == ref_tokens
        assert torch.equal(llm.engine.prompt_logits(LONG), ref_logits)
        assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kwargs, rel, kl", [
    ({"kv_cache_dtype": "fp8"}, 0.10, 0.01),
    ({"kv_cache_dtype": "int8"}, 0.03, 0.001),
    ({"kv_cache_dtype": "int8", "kv_cache_scale": "channel"}, 0.03, 0.001),
    ({"k_cache_dtype": "auto", "v_cache_dtype": "fp8_e4m3"}, 0.10, 0.01),
])
def test_quantized_logits_stay_within_tolerance(tiny, kwargs, rel, kl):
    path, _, ref = tiny
    llm = _llm(path, **kwargs)
    assert all(isinstance(c, QuantizedKVCache) for c in llm.engine.runner.caches)
    logits = llm.engine.prompt_logits(LONG)
    assert not torch.equal(logits, ref), "the quantized cache must actually be read back"
    assert ((logits - ref).norm() / ref.norm()).item() < rel
    div = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    assert div.sum(-1).mean().item() < kl
    assert_no_leaks(llm.engine)


def _step_agreement(llm: LLM, ref_tokens: list[list[int]]) -> float:
    agree = 0
    for prompt, ref in zip(PROMPTS, ref_tokens):
        picks = llm.engine.prompt_logits(prompt + ref[:-1])[len(prompt) - 1 :].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(picks, ref))
    return agree / (len(PROMPTS) * GEN)


def test_fp8_per_token_greedy_agrees_on_most_tokens(tiny):
    path, ref_tokens, _ = tiny
    llm = _llm(path, kv_cache_dtype="fp8_e4m3", kv_cache_scale="token")
    assert _step_agreement(llm, ref_tokens) >= 0.85
    # the free-running output comes through the decode path: every token it chose is the one the
    # quantized cache ranks first for that history (decode reads back what prefill would)
    outs = _greedy(llm)
    for prompt, out in zip(PROMPTS, outs):
        picks = llm.engine.prompt_logits(prompt + out[:-1])[len(prompt) - 1 :].argmax(-1).tolist()
        assert sum(a == b for a, b in zip(picks, out)) >= GEN - 1
    assert_no_leaks(llm.engine)


def test_same_memory_holds_about_twice_the_blocks_at_8_bit(tiny_model_factory):
    """head_dim 64, 2 KV heads, 2 layers, block 16. Per layer-block: fp16 K+V = 16*2*64*2*2 = 8192 B;
    int8 = 4096 B codes + 2 (K,V) * 16 tokens * 4 B scales = 4224 B; fp8 with a static scale = 4096 B."""
    path, _ = tiny_model_factory("llama_gqa", hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    memory = 1 << 20
    blocks = {}
    for name, kwargs in [("fp16", {"kv_cache_dtype": "float16"}), ("int8", {"kv_cache_dtype": "int8"}),
                         ("fp8@tensor", {"kv_cache_dtype": "fp8", "kv_cache_scale": "tensor"}),
                         ("int4", {"kv_cache_dtype": "int4"})]:
        eng = LLM(model=path, log_ledger=False, kv_cache_memory=memory, **kwargs).engine
        per_block = kv_bytes_per_block(eng.model_config.kv_shape(), 16, eng.cache_format)
        assert eng.pool.num_blocks == memory // per_block - 1  # one block of the memory is the pool's null block
        assert sum(c.nbytes for c in eng.runner.caches) == per_block * (eng.pool.num_blocks + 1) <= memory
        blocks[name] = eng.pool.num_blocks
    assert blocks == {"fp16": 1048576 // (2 * 8192) - 1, "int8": 1048576 // (2 * 4224) - 1,
                      "fp8@tensor": 1048576 // (2 * 4096) - 1, "int4": 1048576 // (2 * (2048 + 128)) - 1}
    assert (blocks["fp16"], blocks["int8"], blocks["fp8@tensor"], blocks["int4"]) == (63, 123, 127, 239)
    assert KVCacheFormat("int8", "int8", "token", "auto") == LLM(
        model=path, log_ledger=False, num_kv_blocks=4, kv_cache_dtype="int8").engine.cache_format


@pytest.mark.parametrize("kwargs", [{"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "int4", "kv_cache_scale": "head"},
                                    {"kv_cache_dtype": "int8", "kv_cache_scale": "tensor"}])
def test_scheduling_paths_keep_per_token_quantization_exact(tiny, kwargs):
    """Per-token/head/static scales quantize each token on its own, so chunked prefill, preemption
    (recompute) and prefix-cache hits must reproduce the plain quantized run token for token.
    (A static scale is calibrated on min(256 tokens, the pool) at start-up, so the preempting run
    is compared with a run on the same small pool that serves one request at a time.)"""
    path = tiny[0]
    plain = _greedy(_llm(path, enable_prefix_caching=False, **kwargs))
    assert _greedy(_llm(path, max_num_batched_tokens=7, **kwargs)) == plain
    small = {"num_kv_blocks": 14, "block_size": 8}
    serial = _greedy(_llm(path, max_num_seqs=1, **small, **kwargs))
    llm = _llm(path, **small, **kwargs)
    assert _greedy(llm) == serial
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)
    llm = _llm(path, **kwargs)
    first = _greedy(llm)
    hits_before = llm.engine.kv.stats.hits
    again = _greedy(llm)  # every full prompt block is a hit: the stored quantized blocks are reused
    assert llm.engine.kv.stats.hits > hits_before
    assert first == again == plain
    assert_no_leaks(llm.engine)


def test_channel_scales_with_prefix_hits_preemption_and_forks(tiny):
    """Per-channel K scales are per block, so a block's codes depend on how it was filled; outputs
    still match the unquantized cache on most steps under every scheduling path, nothing leaks."""
    path, ref_tokens, _ = tiny
    for extra in ({}, {"max_num_batched_tokens": 7}, {"num_kv_blocks": 14, "block_size": 8}):
        llm = _llm(path, kv_cache_dtype="int8", kv_cache_scale="channel", **extra)
        outs = _greedy(llm)
        outs2 = _greedy(llm)  # prefix hits on the blocks the first pass stored
        for o in (outs, outs2):
            same = sum(a == b for x, r in zip(o, ref_tokens) for a, b in zip(x, r))
            assert same >= 0.5 * len(PROMPTS) * GEN, extra
        assert _step_agreement(llm, ref_tokens) >= 0.9
        assert_no_leaks(llm.engine)


def test_forked_samples_share_quantized_blocks_copy_on_write(tiny):
    """n=2 greedy: both samples fork from one prefill; the partly filled block is copied with its scales."""
    path = tiny[0]
    for kwargs in ({"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "int8", "kv_cache_scale": "channel"}):
        llm = _llm(path, **kwargs)
        single = _greedy(llm, PROMPTS[:2])
        params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, n=2)
        outs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)
        for out, ref in zip(outs, single):
            assert [c.token_ids for c in out.outputs] == [ref, ref]
        assert_no_leaks(llm.engine)


def test_cache_dtype_options_resolve_and_validate():
    import argparse

    from kvforge.config import CacheConfig
    from kvforge.engine.args import EngineArgs, add_engine_cli_args, engine_args_from_cli

    # quantized sides default to the calibrated per-layer rotation (measured: planner/kv_quality.py)
    fp8 = CacheConfig(kv_cache_dtype="fp8").cache_format("bfloat16")
    assert (fp8.k_dtype, fp8.v_dtype, fp8.rotation) == ("fp8_e4m3", "fp8_e4m3", "auto")
    split = CacheConfig(kv_cache_dtype="int4", k_cache_dtype="auto", kv_cache_scale="head").cache_format("float16")
    assert split == KVCacheFormat("float16", "int4", "head", "auto")
    assert CacheConfig(kv_cache_scale="channel").cache_format("float32") == KVCacheFormat("float32", "float32", None)
    for field, value in (("kv_cache_scale", "block"), ("v_cache_dtype", "int3"), ("k_cache_dtype", "fp4")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(**{field: value})
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    args = engine_args_from_cli(parser.parse_args(
        ["--k-cache-dtype", "auto", "--v-cache-dtype", "fp8", "--kv-cache-scale", "tensor"]))
    assert args.cache_config.cache_format("float32") == KVCacheFormat("float32", "fp8_e4m3", "tensor", "auto")
    args = engine_args_from_cli(parser.parse_args(["--kv-cache-dtype", "int8", "--kv-cache-rotation", "none"]))
    assert args.cache_config.cache_format("float32") == KVCacheFormat("int8", "int8", "token", None)
