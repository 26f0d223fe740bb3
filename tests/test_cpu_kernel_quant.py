"""The CPU decode kernel reading compressed KV in place, against the reference path (gather +
dequantize + attention): every stored format, every scale granularity, K/V splits, GQA groups 1-8,
windows, soft-capping, partly filled and shared blocks."""
from __future__ import annotations

import os

import pytest
import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.cpu_paged import kernel_views, paged_attention_cpu, reads_in_place
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.torch_ref import decode_attention
from kvforge.kv import quant
from kvforge.kv.storage.quantized import QuantizedKVCache
from kernel_builds import run_built_with as _run_built_with
from test_cpu_kernel import HAS_AVX512

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"{cpu_kernel.unavailable_reason()}")

FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8", "int4"]
GRANULARITIES = ["token", "head", "channel", "tensor"]
# bf16: the reference rounds its scores and probabilities to bf16 (the kernel keeps fp32), and the
# test's V has tokens up to 4x larger than unit: outputs of a few units where one bf16 step is ~0.016
TOL = {torch.float32: 3e-6, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
def test_every_code_decodes_as_the_reference_does(name, compute):
    """All 256 byte values of each format (both nibbles for int4), scaled, then rounded to the compute
    dtype: the kernel's decoder against `kvforge.kv.quant.dequantize(...).to(compute)`."""
    fmt = quant.get_format(name)
    codes = torch.arange(256, dtype=torch.uint8)
    if name == "fp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]  # the NaN codes: the quantizer saturates at +-448
    data = codes.view(1, 1, 1, -1).contiguous()
    scale = torch.tensor([[0.37]])
    view = cpu_kernel.PoolView(data, cpu_kernel.FORMAT_CODES[name], 1, data.shape[-1] * (2 if fmt.packed else 1),
                               data.shape[-1], "token", scale)
    got = cpu_kernel.dequantize_row(view, 0, 0, compute)
    want = quant.dequantize(codes, scale[0, 0], fmt, compute).float()
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


def _fill(cache: QuantizedKVCache, d: int, dv: int, lens: list[int], shared: int, gen: torch.Generator,
          chunk: int = 11) -> torch.Tensor:
    """Sequences of `lens` tokens written as the engine writes them: chunks of `chunk` tokens that
    straddle block boundaries (so per-channel scales grow and requantize), the last 3 tokens one at a
    time. Sequences longer than `shared` blocks share the first sequence's first `shared` (full)
    blocks. Blocks are scattered, never in order. Returns the block tables."""
    bs = cache.block_size
    nbs = [-(-n // bs) for n in lens]
    ids = (torch.randperm(cache.num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.long)  # padded with block 0, as the runner does
    firsts = []
    for i, n in enumerate(nbs):
        common = shared if i and n > shared else 0
        tables[i, :common] = tables[0, :common]
        tables[i, common:n] = torch.tensor(ids[: n - common], dtype=torch.long)
        ids = ids[n - common:]
        firsts.append(common * bs)  # the shared prefix is already written
    heads = cache.k_store.data.shape[2]
    for i, n in enumerate(lens):
        pos = torch.arange(firsts[i], n)
        slots = tables[i, pos // bs] * bs + pos % bs
        # outlier channels in K (what per-channel scales are for), a few large tokens in V
        k = torch.randn(len(pos), heads, d, generator=gen) * (1 + 4 * (torch.arange(d) % 7 == 0))
        v = torch.randn(len(pos), heads, dv, generator=gen) * (1 + 3 * (torch.rand(len(pos), 1, 1, generator=gen) > 0.9))
        cuts = list(range(0, max(len(pos) - 3, 0), chunk)) + list(range(max(len(pos) - 3, 0), len(pos) + 1))
        for s, e in zip(cuts, cuts[1:]):
            cache.write(slots[s:e], k[s:e], v[s:e])
    return tables


def _case(k_dtype, v_dtype, gran, compute, heads, kv_heads, d=64, dv=64, bs=16, lens=(130, 1, 7, 16, 33, 100),
          shared=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    cache = QuantizedKVCache(num_blocks, bs, kv_heads, d, dv, k_dtype, v_dtype, gran, compute)
    tables = _fill(cache, d, dv, list(lens), shared, gen)
    q = torch.randn(len(lens), heads, d, generator=gen).to(compute)
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), tables, torch.tensor(lens))
    return q, cache, meta


def _check(q, cache, meta, scale=0.125, window=None, softcap=None, tol=None):
    assert reads_in_place(q, cache)
    ref = decode_attention(q, cache, meta, scale, window, softcap)
    out = paged_attention_cpu(q, cache, meta, scale, window, softcap)
    tol = tol or TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("name", FORMATS)
def test_quantized_decode_matches_reference(name, gran, compute):
    q, cache, meta = _case(name, name, gran, compute, 2, 2)
    gen = torch.Generator().manual_seed(5)
    for group in range(1, 9):  # query heads per KV head
        _check(torch.randn(q.shape[0], 2 * group, 64, generator=gen).to(compute), cache, meta)


@pytest.mark.parametrize("k_dtype,v_dtype,gran", [
    ("float32", "fp8_e4m3", "token"), ("int8", "int4", "channel"), ("fp8_e5m2", "int8", "head"),
    ("bfloat16", "int8", "tensor"), ("float16", "bfloat16", "token"), ("int4", "float32", "channel"),
])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_k_and_v_formats(k_dtype, v_dtype, gran, compute):
    q, cache, meta = _case(k_dtype, v_dtype, gran, compute, 9, 3)
    _check(q, cache, meta)


@pytest.mark.parametrize("window,softcap", [(5, None), (40, None), (None, 30.0), (24, 50.0)])
@pytest.mark.parametrize("name,gran", [("int8", "channel"), ("fp8_e4m3", "token"), ("int4", "head")])
def test_windows_and_softcap(name, gran, window, softcap):
    q, cache, meta = _case(name, name, gran, torch.float32, 8, 2)
    _check(q * 8, cache, meta, 0.2, window, softcap, tol=2e-5)  # large logits: soft-capping matters


@pytest.mark.parametrize("bs,window", [(4, None), (8, 21), (16, 13), (16, None)])
@pytest.mark.parametrize("name,gran", [("int8", "token"), ("int8", "head"), ("fp8_e4m3", "head"), ("fp8_e5m2", "token")])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_8bit_row_factors_across_blocks(name, gran, compute, bs, window):
    """The AVX-512 8-bit paths take a tile's 16 row factors in one load (per-token scales) or one gather
    (per-head) when its rows are consecutive slots, row by row otherwise: blocks smaller than a tile and
    windows that start mid-block make tiles straddle scattered blocks, and GQA 3 reads each KV head's own."""
    q, cache, meta = _case(name, name, gran, compute, 9, 3, bs=bs)
    _check(q, cache, meta, window=window)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_through_the_bf16_value_pass(name, group):
    """Under bf16 compute, fp8 rows are read by table lookup (VPERMI2B, where the CPU has AVX512-VBMI) with
    each row's factor riding on its probability. A context of one token attends with probability 1, so
    with scale 1 the output is the V row itself: every code (normals, subnormals, both signs, zero) must
    come out exactly as the reference decodes it, which checks each table entry and the lane order."""
    fmt = quant.get_format(name)
    codes = torch.arange(256, dtype=torch.uint8)
    nan = (codes & 0x7F) == 0x7F if name == "fp8_e4m3" else (codes & 0x7F) > 0x7C
    codes[nan] = 0  # NaN codes: the quantizer saturates (e4m3 at +-448, e5m2 at +-57344)
    rows = codes.view(4, 64)
    cache = QuantizedKVCache(5, 16, 1, 64, 64, name, name, "token", torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    tables = torch.tensor([[1], [3], [2], [4]])  # one token per sequence, each in a block of its own
    cache.write(tables[:, 0] * 16, torch.randn(4, 1, 64, generator=gen), torch.randn(4, 1, 64, generator=gen))
    cache.v_store.data[tables[:, 0], 0, 0] = rows
    cache.v_store.scale[tables[:, 0], 0] = 1.0
    q = torch.randn(4, group, 64, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata(torch.zeros(4, dtype=torch.long), 4, tables, torch.ones(4, dtype=torch.long))
    assert reads_in_place(q, cache)
    out = paged_attention_cpu(q, cache, meta, 0.125, None, None)
    want = quant.dequantize(rows, 1.0, fmt, torch.bfloat16)
    torch.testing.assert_close(out.float(), want[:, None].expand(4, group, 64).float(), atol=0, rtol=0)


@pytest.mark.parametrize("d,dv,bs", [(32, 32, 4), (48, 24, 1), (16, 16, 5), (128, 128, 16)])
def test_other_head_sizes_and_block_sizes(d, dv, bs):
    for name, gran in (("int8", "channel"), ("int4", "token"), ("fp8_e5m2", "head")):
        q, cache, meta = _case(name, name, gran, torch.float32, 4, 2, d, dv, bs, lens=(40, 1, 5, 17), shared=1)
        _check(q, cache, meta)


def test_tensor_scale_before_any_write_reads_as_one():
    """A calibrated-later static scale: unset, gather reads codes with scale 1, so does the kernel."""
    cache = QuantizedKVCache(4, 4, 1, 8, 8, "int8", "int8", "tensor", torch.float32)
    cache.k_store.data.fill_(3)
    cache.v_store.data.fill_(2)
    k_view, v_view = kernel_views(cache)
    assert float(k_view.scale) == 1.0 and torch.equal(cpu_kernel.dequantize_row(k_view, 5, 0, torch.float32),
                                                      torch.full((8,), 3.0))


def test_quantized_engine_greedy_is_unchanged_by_the_kernel(tiny_model_factory):
    """fp32 greedy tokens with quantized caches: the in-place kernel and the reference backend agree."""
    from kvforge import LLM, SamplingParams

    path, _ = tiny_model_factory("llama_gqa")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for kwargs in ({"kv_cache_dtype": "int8", "kv_cache_scale": "channel"},
                   {"k_cache_dtype": "auto", "v_cache_dtype": "fp8"}):
        outs = {}
        for backend in ("cpu", "torch"):
            llm = LLM(model=path, dtype="float32", log_ledger=False, num_kv_blocks=64, attention_backend=backend,
                      **kwargs)
            assert isinstance(llm.engine.runner.caches[0], QuantizedKVCache)
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                                           sampling_params=params)]
        assert outs["cpu"] == outs["torch"], kwargs


@pytest.mark.build
@pytest.mark.skipif(not HAS_AVX512, reason="this CPU's own build is already the portable (no AVX-512) one")
def test_quantized_kernel_without_avx512_builds_and_matches(kernel_cache):
    """The portable loops (what CPUs without AVX-512 run, and every compressed operand everywhere),
    built with -mno-avx512f, against the reference."""
    code = (
        "import torch, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_cpu_kernel_quant import _case, _check\n"
        "from kvforge.attention import cpu_kernel\n"
        "assert cpu_kernel.available(), cpu_kernel.unavailable_reason()\n"
        "for name, gran in (('fp8_e4m3', 'head'), ('fp8_e5m2', 'tensor'), ('int8', 'channel'), ('int4', 'token')):\n"
        "    for compute in (torch.float32, torch.bfloat16):\n"
        "        q, cache, meta = _case(name, name, gran, compute, 8, 2, lens=(60, 1, 17))\n"
        "        _check(q, cache, meta)\n"
        "print('ok')\n"
    ) % os.path.dirname(__file__)
    _run_built_with("-mno-avx512f", kernel_cache, code)


@pytest.mark.build
@pytest.mark.skipif(not HAS_AVX512, reason="needs an AVX-512 CPU to build the AVX-512 8-bit paths")
@pytest.mark.parametrize("flags", ["-mno-avx512vnni -mno-avx512vbmi", "-mno-avx512bf16"])
def test_8bit_paths_under_bf16_without_vnni_or_bf16_instructions(kernel_cache, flags):
    """Under bf16 compute, int8 K and V take VPDPWSSD (int16 queries and probabilities, exact int32 sums),
    fp8 K and V take VDPBF16PS on codes looked up as bf16 by VPERMI2B (AVX512-VBMI). Built without VNNI
    and VBMI, int8 K and every 8-bit V widen codes through fp32 to bf16 for VDPBF16PS instead, and without
    AVX512-BF16 everything takes the fp32 8-bit path. Each build matches the reference."""
    code = (
        "import torch, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_cpu_kernel_quant import _case, _check\n"
        "from kvforge.attention import cpu_kernel\n"
        "assert cpu_kernel.available(), cpu_kernel.unavailable_reason()\n"
        "for k, v, gran in (('int8', 'int8', 'token'), ('fp8_e4m3', 'int8', 'head'), ('int8', 'fp8_e5m2', 'tensor')):\n"
        "    q, cache, meta = _case(k, v, gran, torch.bfloat16, 9, 3, lens=(60, 1, 17, 300))\n"
        "    _check(q, cache, meta)\n"
        "print('ok')\n"
    ) % os.path.dirname(__file__)
    _run_built_with(flags, kernel_cache, code)
