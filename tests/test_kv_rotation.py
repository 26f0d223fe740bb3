"""The Hadamard-rotated KV cache (kvforge/kv/rotation.py): the transform, its exactness in attention, the error it
removes, where it applies, the default that follows the measurement, and the tier namespace it changes."""
from __future__ import annotations

import math

import pytest
import torch

from kvforge.attention import paged_attention
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.config import CacheConfig
from kvforge.kv.rotation import hadamard_block, rotate
from kvforge.kv.storage.quantized import QuantizedKVCache
from kvforge.ledger import DEFAULT_KV_ROTATION, KVCacheFormat, parse_kv_format


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256, 6])
def test_rotate_is_the_blockwise_normalized_hadamard_matrix_and_its_own_inverse(d):
    n = hadamard_block(d)
    assert n == {64: 64, 80: 16, 96: 32, 128: 128, 256: 256, 6: 2}[d]
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    ref = (x.view(5, 3, d // n, n) @ _sylvester(n)).view(5, 3, d)
    y = rotate(x.float())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate(y), x.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.float().norm(dim=-1))  # orthogonal


def test_rotate_keeps_bf16_inputs_in_bf16_and_leaves_odd_head_sizes_alone():
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert rotate(x).dtype == torch.bfloat16
    odd = torch.randn(3, 7)
    assert rotate(odd) is odd  # hadamard_block(7) == 1: nothing to spread


def _outlier_kv(t: int, heads: int, d: int, seed: int = 0, queries: int = 1):
    """Keys with a few large channels shared by every token (as real models' keys have), and queries that read
    those channels (as the queries meeting them do)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, heads, d, generator=g)
    k[..., 3] += 20.0
    k[..., 17] -= 12.0
    v = torch.randn(t, heads, d, generator=g)
    q = torch.randn(queries, heads, d, generator=g)
    q[..., 3] += 6.0
    q[..., 17] -= 4.0
    return q, k, v


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("granularity", ["token", "head"])
def test_rotated_keys_give_logits_closer_to_the_exact_ones(dtype, granularity):
    """The claim behind the default: with outlier channels in K and q, the logits q.k read from a rotated cache
    (q rotated alike) carry less than half the quantization error of a plain cache's (int8 and fp8 e4m3)."""
    t, heads, d, bs = 256, 2, 64, 16
    q, k, v = _outlier_kv(t, heads, d, queries=64)
    exact = torch.einsum("qhd,thd->hqt", q, k)
    errors = {}
    for rotation in (None, "hadamard"):
        cache = QuantizedKVCache(t // bs, bs, heads, d, d, dtype, dtype, granularity, torch.float32, rotation=rotation)
        assert cache.rotate_k == cache.rotate_v == (rotation is not None)
        cache.write(torch.arange(t), k, v)
        stored_k, _ = cache.gather(torch.arange(t // bs)[None])
        logits = torch.einsum("qhd,thd->hqt", rotate(q) if cache.rotate_k else q, stored_k[0])
        errors[rotation] = (logits - exact).pow(2).mean().sqrt().item()
    assert errors["hadamard"] < errors[None] / 1.5, errors


def test_rotation_is_exact_in_attention_up_to_rounding():
    """Rotating q and K (and un-rotating the output of rotated V) changes no logit: with the cache's
    quantization error taken out (the store's round trip replaced by the identity), rotated and plain
    caches attend alike, including prefill chunks that read earlier tokens back."""
    t, heads, d, bs = 40, 2, 64, 8
    q, k, v = _outlier_kv(t, heads, d, seed=3)
    qs = torch.randn(t, heads, d, generator=torch.Generator().manual_seed(4))
    outs = []
    for rotation in (None, "hadamard"):
        cache = QuantizedKVCache(t // bs, bs, heads, d, d, "int8", "int8", "token", torch.float32, rotation=rotation)
        # an exact store: what goes in comes back, so only the rotation's arithmetic is left
        for store in (cache.k_store, cache.v_store):
            kept = {}
            store.write = lambda slots, x, kept=kept: kept.update(x=x.clone(), slots=slots.clone())
            store.gather = lambda tables, dt, kept=kept: kept["x"][None].to(dt)
        cache.write(torch.arange(t), k, v)
        meta = AttentionMetadata(torch.arange(t), 0, torch.zeros(0, 1, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long),
                                 [PrefillChunk(slice(0, t), 0, t, torch.arange(t // bs))], backend="torch")
        outs.append(paged_attention(qs, cache, meta, 1 / math.sqrt(d)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_only_quantized_sides_are_rotated():
    split = QuantizedKVCache(2, 16, 2, 64, 64, "bfloat16", "int8", "token", torch.bfloat16, rotation="hadamard")
    assert (split.rotate_k, split.rotate_v) == (False, True)
    k_only = QuantizedKVCache(2, 16, 2, 64, 64, "fp8_e4m3", "float32", "head", torch.float32, rotation="hadamard")
    assert (k_only.rotate_k, k_only.rotate_v) == (True, False)
    with pytest.raises(ValueError, match="rotation"):
        QuantizedKVCache(2, 16, 2, 64, 64, "int8", "int8", "token", torch.float32, rotation="random")


def test_the_default_is_auto_and_each_choice_is_honoured():
    assert DEFAULT_KV_ROTATION == "auto"
    assert CacheConfig(kv_cache_dtype="fp8").cache_format("bfloat16").rotation == "auto"
    assert CacheConfig(kv_cache_dtype="fp8", kv_cache_rotation="hadamard").cache_format("bfloat16").rotation == \
        "hadamard"
    assert CacheConfig(kv_cache_dtype="int8", kv_cache_rotation="none").cache_format("float32").rotation is None
    assert CacheConfig().cache_format("bfloat16") == KVCacheFormat("bfloat16", "bfloat16", None, None)  # 16-bit
    assert CacheConfig(k_cache_dtype="auto", v_cache_dtype="int8").cache_format("bfloat16").rotation == "auto"
    with pytest.raises(ValueError, match="kv_cache_rotation"):
        CacheConfig(kv_cache_rotation="random")


def test_auto_starts_with_the_integer_sides_rotated():
    """Without a calibration (tensor-parallel ranks, caches built directly) "auto" rotates int8/int4 sides,
    whose error the rotation lowered in every layer measured, and leaves fp8 sides plain."""
    mixed = QuantizedKVCache(2, 16, 2, 64, 64, "fp8_e4m3", "int8", "token", torch.float32, rotation="auto")
    assert (mixed.rotate_k, mixed.rotate_v) == (False, True)
    assert mixed.rotatable == (True, True)


def test_calibration_keeps_the_side_with_the_lower_attention_error():
    """A key with one large channel: int8's step is set by it, so rotating lowers the error; fp8's step is
    relative, and rotating spreads the large channel's rounding over channels the queries read, so plain
    wins. `side_errors` measures exactly that, through scratch stores of the layer's own format."""
    from kvforge.engine.rotation_calibration import side_errors

    g = torch.Generator().manual_seed(0)
    t, h, d = 128, 2, 64
    k = torch.randn(t, h, d, generator=g)
    k[..., 3] += 20
    q, v = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)
    q[..., 3] = 0
    errs = {}
    for dtype in ("int8", "fp8_e4m3"):
        cache = QuantizedKVCache(8, 16, h, d, d, dtype, dtype, "head", torch.float32, rotation="auto")
        errs[dtype] = side_errors(cache, q, k, v, 1 / 8, None, None)
    assert errs["int8"]["k"][1] < errs["int8"]["k"][0] / 2
    assert errs["fp8_e4m3"]["k"][0] < errs["fp8_e4m3"]["k"][1] / 2


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_engine_calibrates_each_layer_and_says_so(tiny_model_factory, kv_cache_dtype):
    """At start-up an "auto" engine runs the calibration prompt, sets each layer's sides to the lower measured
    error, frees the prompt's blocks, names the counts in the ledger, and a rerun decides the same."""
    from kvforge import LLM
    from kvforge.engine.rotation_calibration import calibrate_rotation

    path, _ = tiny_model_factory("llama_gqa")
    engine = LLM(model=path, log_ledger=False, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype).engine
    caches = engine.runner.caches
    flags = [(c.rotate_k, c.rotate_v) for c in caches]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert "Hadamard-rotated: K in" in engine.report.kv_dtype
    errors = calibrate_rotation(engine)
    assert len(errors) == len(caches)
    for c, e in zip(caches, errors):
        assert (c.rotate_k, c.rotate_v) == (e["k"][1] < e["k"][0], e["v"][1] < e["v"][0])
    assert [(c.rotate_k, c.rotate_v) for c in caches] == flags
    from kvforge import SamplingParams  # and an engine serves after calibrating
    text = LLM(model=path, log_ledger=False, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype).generate(
        prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(text[0].outputs[0].token_ids) == 4


def test_calibration_refuses_a_busy_pool(tiny_model_factory):
    from kvforge import LLM, SamplingParams
    from kvforge.engine.rotation_calibration import calibrate_rotation

    path, _ = tiny_model_factory("llama_gqa")
    engine = LLM(model=path, log_ledger=False, num_kv_blocks=64, kv_cache_dtype="int8").engine
    engine.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))
    engine.step()
    with pytest.raises(RuntimeError, match="rotation"):
        calibrate_rotation(engine)


def test_the_format_grammar_names_the_rotation():
    assert parse_kv_format("int8:none").resolve("float32") == KVCacheFormat("int8", "int8", "token", None)
    assert parse_kv_format("fp8@token:hadamard").resolve("float32").rotation == "hadamard"
    assert parse_kv_format("fp8/fp16").resolve("float32").rotation == "auto"  # V is not quantized: K alone
    assert parse_kv_format("bf16:none").resolve("float32").rotation is None  # nothing quantized, nothing rotated
    with pytest.raises(ValueError, match="--formats item.*rotation must be one of auto, hadamard, none"):
        parse_kv_format("int8:random", "--formats item")


def test_a_rotated_cache_is_its_own_tier_namespace(monkeypatch):
    """Blocks written rotated must never load into a plain cache (or back): the KV tiers' namespace, which
    names the disk cache's files and guards each block's header, includes the rotation."""
    from kvforge.engine.args import TierConfig
    from kvforge.kv.tiers import setup

    seen = []
    real = setup.namespace_digest
    monkeypatch.setattr(setup, "namespace_digest", lambda fields: seen.append(real(fields)) or seen[-1])
    caches = [QuantizedKVCache(4, 16, 2, 64, 64, "int8", "int8", "token", torch.float32)]
    for rotation in ("hadamard", None):
        setup.build_tiers(caches, "model", KVCacheFormat("int8", "int8", "token", rotation), 16, 4,
                          TierConfig(kv_offload_memory="1MiB"), torch.device("cpu"))
    caches[0].rotate_k = not caches[0].rotate_k  # "auto": the per-layer decisions are part of it too
    setup.build_tiers(caches, "model", KVCacheFormat("int8", "int8", "token", None), 16, 4,
                      TierConfig(kv_offload_memory="1MiB"), torch.device("cpu"))
    assert len(set(seen)) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_the_c_and_torch_rotations_give_the_same_bits(dtype, d):
    """CPU rotates in C (kv/csrc/kv_rotate.c, also the fused decode call's), CUDA in torch: the same additions
    in the same order, so a cache written by one path reads the same through the other; in place too."""
    from kvforge.kv.rotation import LIBRARY, rotate_torch

    if LIBRARY.load() is None:
        pytest.skip(f"no C rotation here: {LIBRARY.error}")
    x = torch.randn(301, 7, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    want = rotate_torch(x)
    assert torch.equal(rotate(x), want)
    y = x.clone()
    assert rotate(y, out=y) is y and torch.equal(y, want)
