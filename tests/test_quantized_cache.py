"""QuantizedKVCache: write/gather through slots, per-block channel scales, copy_blocks, bytes == ledger."""
from __future__ import annotations

import pytest
import torch

from kvforge.config import ModelConfig
from kvforge.kv.storage.build import make_layer_caches
from kvforge.kv.quant import get_format, round_trip
from kvforge.kv.storage.quantized import QuantizedKVCache
from kvforge.ledger import KVCacheFormat, KVShape, kv_bytes_per_block

BS, H, D = 4, 2, 8
QUANT = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")


def _cache(k="int8", v="int8", gran="token", blocks=6, dv=D, dtype=torch.float32) -> QuantizedKVCache:
    return QuantizedKVCache(blocks, BS, H, D, dv, k, v, gran, dtype)


def _rand(n, seed=0, dim=D):
    return torch.randn(n, H, dim, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("gran", ["token", "head"])
@pytest.mark.parametrize("name", QUANT)
def test_write_then_gather_equals_the_round_trip_at_each_slot(name, gran):
    cache = _cache(name, name, gran)
    k, v = _rand(6, 1), _rand(6, 2)
    slots = torch.tensor([9, 10, 11, 0, 1, 2])  # block 2 offsets 1..3, block 0 offsets 0..2
    cache.write(slots, k, v)
    gk, gv = cache.gather(torch.tensor([[2, 0]]))
    assert gk.dtype == torch.float32 and gk.shape == (1, 2 * BS, H, D)
    rows = torch.tensor([1, 2, 3, 4, 5, 6])  # where the slots land in the gathered [block 2, block 0] context
    assert torch.equal(gk[0, rows], round_trip(k, gran, name))
    assert torch.equal(gv[0, rows], round_trip(v, gran, name))


@pytest.mark.parametrize("name", QUANT)
def test_channel_scales_when_a_block_fills_one_token_at_a_time(name):
    """Decode appends: each growth of a channel's running max requantizes the block; nothing clips,
    and every value stays within half the sum of the steps it was stored under."""
    cache = _cache(name, name, "channel")
    fmt = get_format(name)
    k = _rand(BS, 3)
    k[2, 0, 3] = 40.0  # an outlier arrives mid-block
    history = []
    for t in range(BS):
        cache.write(torch.tensor([5 * BS + t]), k[t : t + 1], k[t : t + 1])
        history.append(cache.k_store.scale[5].clone())  # [H, D] after token t
    got, _ = cache.gather(torch.tensor([[5]]))
    err = (got[0] - k).abs()
    for t in range(BS):
        scales = torch.stack(history[t:]).unique_consecutive(dim=0) if t < BS - 1 else history[t][None]
        if fmt.float_dtype is None:  # integer codes: half a step per (re)quantization
            bound = scales.sum(0) / 2
        else:  # fp8: relative rounding per (re)quantization
            ulp = 2.0 ** (-4 if name == "fp8_e4m3" else -3)
            bound = k[t].abs() * ((1 + ulp) ** len(scales) - 1) + scales.sum(0) * torch.finfo(fmt.float_dtype).tiny
        assert (err[t] <= bound * (1 + 1e-5) + 1e-6).all(), t
    final = history[-1]
    assert torch.allclose(final, k.abs().amax(0).clamp_min(1e-12) / fmt.qmax)  # running max == block max
    assert got[0, 2, 0, 3].item() == pytest.approx(40.0, rel=0.07)  # the outlier itself is not clipped


def test_channel_block_written_in_one_chunk_matches_the_round_trip():
    cache = _cache("int8", "int8", "channel")
    k, v = _rand(BS, 4), _rand(BS, 5)
    cache.write(torch.arange(BS, 2 * BS), k, v)
    gk, gv = cache.gather(torch.tensor([[1]]))
    assert torch.equal(gk[0], round_trip(k, "channel", "int8"))
    assert torch.equal(gv[0], round_trip(v, "token", "int8"))  # V falls back to per-token scales
    assert cache.v_store.granularity == "token"


def test_recycled_block_forgets_its_previous_owner():
    cache = _cache("int8", "int8", "channel")
    cache.write(torch.arange(0, BS), _rand(BS, 6) * 100, _rand(BS, 6))
    small = _rand(2, 7) * 0.01
    cache.write(torch.tensor([0, 1]), small, small)  # a new request starts block 0 at offset 0
    gk, _ = cache.gather(torch.tensor([[0]]))
    assert torch.equal(gk[0, :2], round_trip(small, "channel", "int8"))


def test_copy_blocks_copies_codes_and_scales():
    for gran in ("token", "head", "channel"):
        cache = _cache("int4", "fp8_e4m3", gran)
        cache.write(torch.arange(BS, BS + 3), _rand(3, 8), _rand(3, 9))
        cache.copy_blocks([(1, 4)])
        src, dst = cache.gather(torch.tensor([[1]])), cache.gather(torch.tensor([[4]]))
        assert torch.equal(src[0], dst[0]) and torch.equal(src[1], dst[1])
        # copy-on-write: the copy takes the next token; the shared source is untouched
        cache.write(torch.tensor([4 * BS + 3]), _rand(1, 10) * 50, _rand(1, 11))
        after = cache.gather(torch.tensor([[1]]))
        assert torch.equal(after[0], src[0]) and torch.equal(after[1], src[1]), gran


def test_split_formats_keep_the_dense_half_exact_and_return_the_compute_dtype():
    cache = _cache("float32", "fp8_e4m3", "token")
    k, v = _rand(3, 12), _rand(3, 13)
    cache.write(torch.tensor([0, 1, 2]), k, v)
    gk, gv = cache.gather(torch.tensor([[0]]))
    assert torch.equal(gk[0, :3], k)
    assert torch.equal(gv[0, :3], round_trip(v, "token", "fp8_e4m3"))
    bf = _cache("bfloat16", "int8", "head", dtype=torch.float32)
    bf.write(torch.tensor([0]), k[:1], v[:1])
    assert bf.gather(torch.tensor([[0]]))[0].dtype == torch.float32


def test_static_tensor_scale_is_set_by_the_first_write_then_fixed():
    cache = _cache("int8", "int8", "tensor")
    first = _rand(4, 14)
    cache.write(torch.arange(4), first, first)
    scale = cache.k_store.static_scale.item()
    assert scale == pytest.approx(first.abs().max().item() / 127)
    cache.write(torch.tensor([4]), first[:1] * 10, first[:1] * 10)  # beyond the scale: saturates, never NaN
    assert cache.k_store.static_scale.item() == scale
    gk, _ = cache.gather(torch.tensor([[1]]))
    assert gk[0, 0].abs().max().item() == pytest.approx(127 * scale)


@pytest.mark.parametrize(
    "k, v, gran",
    [(q, q, g) for q in QUANT for g in ("token", "head", "channel", "tensor")]
    + [("float32", "fp8_e4m3", "token"), ("int4", "bfloat16", "channel"), ("float16", "float32", None)],
)
def test_nbytes_equals_the_ledger_exactly(k, v, gran):
    shape = KVShape(1, 3, 10, v_head_dim=6)  # odd-looking sizes catch amortisation rounding
    cache = QuantizedKVCache(7, 5, 3, 10, 6, k, v, gran, torch.float32)
    assert cache.nbytes == kv_bytes_per_block(shape, 5, KVCacheFormat(k, v, gran)) * 7


def test_factory_picks_storage_per_format_and_rejects_odd_int4_dims():
    cfg = ModelConfig.from_hf({"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
                               "num_hidden_layers": 3, "vocab_size": 100})
    fmt = KVCacheFormat("int8", "int4", "channel")
    caches = make_layer_caches(cfg, fmt, 9, 16, torch.device("cpu"), torch.float32)
    assert len(caches) == 3 and all(isinstance(c, QuantizedKVCache) for c in caches)
    assert sum(c.nbytes for c in caches) == kv_bytes_per_block(cfg.kv_shape(), 16, fmt) * 9
    dense = make_layer_caches(cfg, KVCacheFormat("float32", "float32"), 9, 16, torch.device("cpu"), torch.float32)
    assert not isinstance(dense[0], QuantizedKVCache)
    with pytest.raises(ValueError, match="even head_dim"):
        QuantizedKVCache(2, 4, 1, 7, 7, "int4", "int4", "token", torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        QuantizedKVCache(2, 4, 1, 8, 8, "int2", "int8", "token", torch.float32)
