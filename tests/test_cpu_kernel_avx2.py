"""The decode kernel's AVX2 path (head size 64, G <= 8, every storage format: what CPUs without AVX-512
run, and compressed operands on CPUs with it) against the reference, and the portable loops it
replaced, built with `-mno-avx2 -mno-fma`, still against the reference. Most of the path's coverage
is the existing quantized-kernel tests (every format and granularity, G 1-8, windows, soft-capping,
shared and partly filled blocks at head size 64); these add what those cannot see."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.cpu_paged import paged_attention_cpu
from kvforge.kv import quant
from test_cpu_kernel_quant import FORMATS, _case, _check

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"{cpu_kernel.unavailable_reason()}")


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", FORMATS)
def test_value_rows_decode_every_code_exactly(name, compute, group):
    """One-token contexts: each query head's output is its V row times a probability of exactly 1, so
    every code of the format, read by the vector V pass (scaled per row, rounded to the compute dtype),
    must come out as `quant.dequantize(...).to(compute)`, bit for bit. The one exception is by design: fp8
    rows under bf16 compute read by table (AVX512-VBMI) carry the row's factor on the probability, so there
    an element may instead be the code times the factor rounded to bf16 (one rounding per term instead of
    the reference's two), and nothing else."""
    fmt = quant.get_format(name)
    codes = torch.arange(256, dtype=torch.uint8)
    if name == "fp8_e4m3":
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # the NaN codes: the quantizer saturates at +-448
    width = 32 if fmt.packed else 64  # bytes of one head's row
    rows = 256 // width
    data = codes.view(rows, 1, 1, width).contiguous()
    scale = torch.linspace(0.05, 3.0, rows).view(rows, 1)  # one per token (block size 1)
    v = cpu_kernel.PoolView(data, cpu_kernel.FORMAT_CODES[name], 1, 64, width, "token", scale)
    k = cpu_kernel.dense_view(torch.randn(rows, 1, 1, 64).to(compute))
    q = torch.randn(rows, group, 64).to(compute)
    out = cpu_kernel.paged_decode(q, k, v, torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.long), 0.125)
    want = quant.dequantize(data.view(rows, width), scale, fmt, compute)
    if fmt.float_dtype is not None and compute == torch.bfloat16:
        folded = (data.view(rows, width).view(fmt.float_dtype).float() * scale.to(compute).float()).to(compute)
        want = torch.where(out[:, 0] == folded, folded, want)
    for g in range(group):
        torch.testing.assert_close(out[:, g], want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k_dtype,v_dtype,gran", [
    ("int8", "int8", "channel"), ("fp8_e4m3", "fp8_e5m2", "head"), ("float32", "int8", "token"),
    ("fp8_e5m2", "bfloat16", "tensor"), ("int4", "fp8_e4m3", "channel"),
])
def test_groups_and_splits_with_partly_filled_shared_blocks(group, k_dtype, v_dtype, gran):
    """Contexts of 1-130 tokens (not multiples of the 8-row score or 16-row value steps), the first
    blocks shared, block size 5; windows and soft-capping on the same cache."""
    q, cache, meta = _case(k_dtype, v_dtype, gran, torch.float32, 2 * group, 2, bs=5,
                           lens=(130, 1, 7, 9, 16, 33), shared=3)
    _check(q, cache, meta)
    _check(q * 8, cache, meta, 0.2, 13, None, tol=2e-5)
    _check(q * 8, cache, meta, 0.2, None, 30.0, tol=2e-5)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_bf16_compute_rounds_dequantized_rows(group):
    q, cache, meta = _case("fp8_e4m3", "int8", "channel", torch.bfloat16, 2 * group, 2, lens=(70, 3, 24))
    _check(q, cache, meta)


@pytest.mark.build
def test_portable_build_without_avx2_matches_the_reference_and_this_build(tmp_path, kernel_cache):
    """The scalar/auto-vectorised loops (CPUs without AVX2, and shapes outside the vector paths), built
    with `-mno-avx512f -mno-avx2 -mno-fma`: dense and compressed caches against the reference, and an
    int8 K / fp8 V cache with fp32 compute against this CPU's build (the same products summed and
    scaled in another order, so equal to fp32 rounding)."""
    split = "'int8', 'fp8_e5m2', 'head', torch.float32, 12, 3, lens=(1, 9, 100, 333)"
    q, cache, meta = _case("int8", "fp8_e5m2", "head", torch.float32, 12, 3, lens=(1, 9, 100, 333))
    here = paged_attention_cpu(q, cache, meta, 0.125)
    code = (
        "import torch, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_cpu_kernel import _decode_batch\n"
        "from test_cpu_kernel_quant import _case, _check\n"
        "from kvforge.attention import cpu_kernel\n"
        "from kvforge.attention.cpu_paged import paged_attention_cpu\n"
        "from kvforge.attention.torch_ref import decode_attention\n"
        "assert cpu_kernel.available(), cpu_kernel.unavailable_reason()\n"
        "q, cache, meta = _case(%s)\n"
        "torch.save(paged_attention_cpu(q, cache, meta, 0.125), %r)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    q, cache, meta = _decode_batch(dtype, 9, 3, 64, 64, 16, lens=[1, 17, 100])\n"
        "    ref = decode_attention(q, cache, meta, 0.125)\n"
        "    out = cpu_kernel.paged_decode(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, 0.125)\n"
        "    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)\n"
        "for k, v, gran in (('fp8_e4m3', 'fp8_e4m3', 'head'), ('int8', 'fp8_e5m2', 'channel'), ('int4', 'int4', 'token')):\n"
        "    for compute in (torch.float32, torch.bfloat16):\n"
        "        q, cache, meta = _case(k, v, gran, compute, 8, 2, lens=(60, 1, 17))\n"
        "        _check(q, cache, meta)\n"
        "print('ok')\n"
    ) % (os.path.dirname(__file__), split, str(tmp_path / "out.pt"))
    env = dict(os.environ, KVFORGE_EXTRA_CFLAGS="-mno-avx512f -mno-avx2 -mno-fma",
               KVFORGE_CACHE_DIR=str(kernel_cache))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    torch.testing.assert_close(here, torch.load(tmp_path / "out.pt"), atol=1e-6, rtol=1e-5)
