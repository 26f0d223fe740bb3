"""The Triton kernels (`kvforge.attention.triton`, `kvforge.kv.storage.triton_codec`) against the torch reference.

Without a GPU they run in Triton's interpreter on CPU tensors: TRITON_INTERPRET is set here, at
collection, before any kernel module is imported (the kernels import lazily for that reason). With
CUDA the same tests run on the device (`benchmarks/gpu_check.sh` runs this file there). The
interpreter runs programs one by one, so shapes are small: a few blocks, two sequences.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvforge.attention import paged_attention  # noqa: E402
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk  # noqa: E402
from kvforge.attention.torch_ref import paged_attention as reference  # noqa: E402
from kvforge.attention.triton import paged_attention_triton, reads_in_place  # noqa: E402
from kvforge.kv.storage.dense import DenseKVCache  # noqa: E402
from kvforge.kv.storage.mla_latent import LatentKVCache  # noqa: E402
from kvforge.kv.quant import get_format, quantize, absmax_scales, expand_scale  # noqa: E402
from kvforge.kv.storage.quantized import QuantizedKVCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NB, BS, HKV, H, D = 12, 8, 2, 6, 16
TABLES = [[3, 5, 7, 1, 0], [2, 4, 6, 8, 9]]
LENS = [37, 20]  # the first sequence ends mid-block in its fifth block; the second fills 2.5 blocks
SCALE = 0.3


def _decode_meta() -> AttentionMetadata:
    return AttentionMetadata(torch.zeros(0, dtype=torch.long, device=DEVICE), 2,
                             torch.tensor(TABLES, device=DEVICE), torch.tensor(LENS, device=DEVICE))


def _mixed_meta() -> AttentionMetadata:
    """Two decode rows, then a chunk over a 13-token cached prefix and a first chunk of 21 tokens."""
    chunks = [PrefillChunk(slice(2, 9), 13, 20, torch.tensor([4, 6, 8], device=DEVICE)),
              PrefillChunk(slice(9, 30), 0, 21, torch.tensor([9, 10, 11], device=DEVICE))]
    meta = _decode_meta()
    meta.prefills = chunks
    return meta


def _dense(dtype=torch.float32, v_dim: int = D) -> DenseKVCache:
    cache = DenseKVCache(NB, BS, HKV, D, v_dim, dtype, DEVICE)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def _quantized(k_dtype: str, v_dtype: str, gran: str) -> QuantizedKVCache:
    cache = QuantizedKVCache(NB, BS, HKV, D, D, k_dtype, v_dtype, gran, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(NB * BS, HKV, D, generator=g)
    k[:, :, 3] *= 8  # an outlier channel, as keys have
    cache.write(torch.arange(NB * BS, device=DEVICE), k.to(DEVICE), torch.randn(NB * BS, HKV, D, generator=g).to(DEVICE))
    return cache


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err < tol, f"max abs error {err} >= {tol}"


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_dense_fp32_matches_reference_for_any_split_count(splits):
    cache, q = _dense(), torch.randn(2, H, D, device=DEVICE)
    assert reads_in_place(q, cache)
    _close(paged_attention_triton(q, cache, _decode_meta(), SCALE, num_splits=splits),
           reference(q, cache, _decode_meta(), SCALE), 1e-5)


@pytest.mark.parametrize("window,softcap", [(9, None), (None, 5.0)])
def test_decode_window_and_softcap(window, softcap):
    cache, q = _dense(), torch.randn(2, H, D, device=DEVICE) * 3
    _close(paged_attention_triton(q, cache, _decode_meta(), SCALE, window, softcap, num_splits=2),
           reference(q, cache, _decode_meta(), SCALE, window, softcap), 1e-5)


def test_mixed_step_bf16_decode_rows_and_prefill_chunks():
    """One launch each for the decode rows and both chunks; bf16 pool and queries (fp32 softmax inside)."""
    cache = _dense(torch.bfloat16)
    q = torch.randn(30, H, D, device=DEVICE).to(torch.bfloat16)
    meta = _mixed_meta()
    ref = reference(q.float(), _as_fp32(cache), meta, SCALE)
    _close(paged_attention_triton(q, cache, meta, SCALE), ref, 3e-2)


def _as_fp32(cache: DenseKVCache) -> DenseKVCache:
    out = DenseKVCache(NB, BS, HKV, D, cache.v.shape[-1], torch.float32, DEVICE)
    out.k.copy_(cache.k.float())
    out.v.copy_(cache.v.float())
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (5, 3.0)])
def test_prefill_chunks_over_cached_prefix(window, softcap):
    cache, q = _dense(), torch.randn(30, H, D, device=DEVICE)
    meta = _mixed_meta()
    meta.num_decodes = 0  # prefill rows only; the chunks' rows start at 2, which no backend returns
    meta.prefills = [PrefillChunk(slice(r.rows.start - 2, r.rows.stop - 2), r.start, r.seq_len, r.block_table)
                     for r in meta.prefills]
    _close(paged_attention_triton(q[:28], cache, meta, SCALE, window, softcap),
           reference(q[:28], cache, meta, SCALE, window, softcap), 1e-5)


QUANT_MIXES = [("fp8_e4m3", "fp8_e4m3", "token"), ("fp8_e5m2", "fp8_e5m2", "head"), ("int8", "int8", "channel"),
               ("int4", "int4", "tensor"), ("int4", "float16", "head"), ("bfloat16", "int8", "token")]


@pytest.mark.parametrize("k_dtype,v_dtype,gran", QUANT_MIXES, ids=["-".join(m) for m in QUANT_MIXES])
def test_quantized_pools_read_in_place_match_reference_dequantize(k_dtype, v_dtype, gran):
    """The kernels decode codes and scales in registers exactly as the store's gather dequantizes them."""
    cache = _quantized(k_dtype, v_dtype, gran)
    q = torch.randn(30, H, D, device=DEVICE)
    meta = _mixed_meta()
    assert reads_in_place(q, cache)
    _close(paged_attention_triton(q, cache, meta, SCALE, num_splits=2), reference(q, cache, meta, SCALE), 1e-5)


def test_mla_absorbed_decode_reads_the_latent_pool_as_k_and_v():
    from kvforge.attention.mla import _AbsorbedView

    rank, rope = 128, 16  # 144 latent channels: 16 query heads per program, so 20 heads take two
    latent = LatentKVCache(NB, BS, rank, rope, torch.float32, DEVICE)
    latent.latent.normal_()
    view = _AbsorbedView(latent)
    q = torch.randn(2, 20, rank + rope, device=DEVICE)
    assert reads_in_place(q, view)
    _close(paged_attention_triton(q, view, _decode_meta(), SCALE, num_splits=2),
           reference(q, view, _decode_meta(), SCALE), 1e-5)


def test_dispatch_takes_triton_only_when_asked_or_on_cuda():
    cache, q = _dense(), torch.randn(2, H, D, device=DEVICE)
    meta = _decode_meta()
    meta.backend = "triton"
    _close(paged_attention(q, cache, meta, SCALE), reference(q, cache, _decode_meta(), SCALE), 1e-5)


def _plus_zero(codes: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """fp8 codes with -0 (0x80) read as +0: a value too small for fp8 rounds to a zero whose sign torch keeps
    and Triton's interpreter does not; both decode to exactly 0.0 (seen on about 1 random input in 75)."""
    if not fmt_name.startswith("fp8"):
        return codes
    return torch.where(codes == 0x80, torch.zeros_like(codes), codes)


WRITE_CASES = [("fp8_e4m3", "token"), ("fp8_e5m2", "head"), ("int8", "tensor"), ("int8", "head"), ("int4", "token"),
               ("int4", "head")]


@pytest.mark.parametrize("fmt_name,gran", WRITE_CASES, ids=["-".join(c) for c in WRITE_CASES])
def test_quantize_on_write_kernel_gives_torch_codes_and_scales(fmt_name, gran):
    from kvforge.kv.storage.triton_codec import quantize_rows_triton

    fmt = get_format(fmt_name)
    torch.manual_seed(37)  # an input where a tiny negative value rounds to fp8 -0 in torch (see _plus_zero)
    x = torch.randn(5, HKV, D) * torch.tensor([0.01, 3.0])[None, :, None]
    x[2] = 0.0  # an all-zero row gets the floor scale, not a division by zero
    slots = torch.tensor([17, 3, 40, 41, 8])
    codes = torch.zeros(NB * BS, HKV, fmt.stored_dim(D), dtype=torch.uint8, device=DEVICE)
    scales = {"token": torch.zeros(NB * BS, device=DEVICE), "head": torch.zeros(NB * BS, HKV, device=DEVICE),
              "tensor": None}[gran]
    static = absmax_scales(x, "tensor", fmt).reshape(1) if gran == "tensor" else None
    quantize_rows_triton(x.to(DEVICE), slots.to(DEVICE), codes, scales, fmt_name, fmt.qmax, gran,
                         None if static is None else static.to(DEVICE))
    codes = codes.cpu()
    want_scale = static[0] if static is not None else absmax_scales(x, gran, fmt)
    want = quantize(x, want_scale if static is not None else expand_scale(want_scale, gran), fmt)
    assert torch.equal(_plus_zero(codes[slots], fmt_name), _plus_zero(want, fmt_name))
    if scales is not None:
        assert torch.equal(scales.cpu()[slots], want_scale)
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    untouched[slots] = False
    assert not codes[untouched].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the store takes the Triton write on CUDA tensors only")
@pytest.mark.gpu
def test_quantized_store_writes_through_triton_on_cuda():
    cache = _quantized("int8", "fp8_e4m3", "head")
    cpu = QuantizedKVCache(NB, BS, HKV, D, D, "int8", "fp8_e4m3", "head", torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    k = torch.randn(NB * BS, HKV, D, generator=g)
    k[:, :, 3] *= 8
    cpu.write(torch.arange(NB * BS), k, torch.randn(NB * BS, HKV, D, generator=g))
    assert torch.equal(cache.k_store.data.cpu(), cpu.k_store.data)
    assert torch.equal(cache.v_store.data.cpu(), cpu.v_store.data)


@pytest.mark.parametrize("fmt_name", ["int8", "int4", "fp8_e4m3"])
def test_per_channel_rescale_without_host_sync_gives_the_same_codes(fmt_name):
    """The GPU's sync-free rescale of per-channel blocks (every touched block recomputed, the grown ones
    kept) writes exactly the codes of the CPU's path, which touches only the grown blocks."""
    import copy

    from kvforge.kv.storage.k_or_v_stores import QuantStore

    fmt = get_format(fmt_name)
    g = torch.Generator().manual_seed(3)
    store = QuantStore(4, BS, HKV, D, fmt, "channel", "cpu")
    store.write(torch.arange(8, 12), torch.randn(4, HKV, D, generator=g))  # block 1
    store.write(torch.arange(16, 20), torch.randn(4, HKV, D, generator=g))  # block 2
    uniq = torch.tensor([1, 2])
    old = store.block_scales[uniq].clone()
    grow = torch.ones(2, HKV, D)
    grow[0, :, ::3] = 4.0  # block 1: a third of its channels grow; block 2 keeps its scales
    new = old * grow
    grown = ((new > old) & (old > 0)).flatten(1).any(dim=1)
    assert grown.tolist() == [True, False]
    cpu, gpu = copy.deepcopy(store), copy.deepcopy(store)
    cpu._rescale(uniq, old, new, grown, sync_free=False)
    gpu._rescale(uniq, old, new, grown, sync_free=True)
    assert torch.equal(cpu.data, gpu.data)
    assert not torch.equal(cpu.data[1], store.data[1]) and torch.equal(cpu.data[2], store.data[2])
