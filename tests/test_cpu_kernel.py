"""The in-place CPU decode kernel against the reference decode (the torch backend's ground truth)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.torch_ref import decode_attention
from kvforge.kv.storage.dense import DenseKVCache

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"{cpu_kernel.unavailable_reason()}")

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and " avx512f " in ln + " " for ln in f)
    except OSError:
        return False


HAS_AVX512 = _cpu_has_avx512()  # the prefill kernel is AVX-512 only; other CPUs prefill through SDPA
needs_prefill_kernel = pytest.mark.skipif(not HAS_AVX512, reason="the prefill kernel needs AVX-512")


def _decode_batch(dtype, heads, kv_heads, d, dv, block_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = sum(nbs) + 3
    cache = DenseKVCache(num_blocks, block_size, kv_heads, d, dv, dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, never in order
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.long)  # padded with block 0, as the runner does
    for i, n in enumerate(nbs):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), tables, torch.tensor(lens))
    return q, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,d,dv,block_size",
    [(9, 3, 64, 64, 16), (4, 4, 32, 32, 4), (8, 1, 40, 40, 16), (6, 2, 48, 24, 1), (2, 1, 16, 16, 5),
     (16, 2, 64, 64, 16), (12, 1, 64, 64, 16), (4, 4, 64, 64, 7)],
    ids=["gqa", "mha", "mqa-d40", "dv-differs-bs1", "odd-block", "d64-8-per-group", "d64-12-per-group", "d64-mha"],
)
def test_kernel_matches_reference(dtype, heads, kv_heads, d, dv, block_size):
    q, cache, meta = _decode_batch(dtype, heads, kv_heads, d, dv, block_size, lens=[1, 7, 16, 17, 100, 333])
    ref = decode_attention(q, cache, meta, d**-0.5)
    out = cpu_kernel.paged_decode(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, d**-0.5)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (6, 3), (9, 3), (16, 2), (8, 4), (2, 2)],
                         ids=["mha3", "gqa2", "gqa3", "gqa8", "gqa2x4", "mha2"])
@pytest.mark.parametrize("window", [None, 40])
def test_fp32_whole_row_passes_match_the_reference(heads, kv_heads, window):
    """fp32 rows of several KV heads per work item (batches of >= 2 sequences a thread) take the whole-row
    passes, rows of KVF_ROW_STREAMS 16-row tiles in turn: lengths around the tile and tile-group edges."""
    lens = [1, 15, 16, 47, 48, 49, 97, 145, 400]
    q, cache, meta = _decode_batch(torch.float32, heads, kv_heads, 64, 64, 16, lens=lens, seed=3)
    ref = decode_attention(q, cache, meta, 0.125, window)
    out = cpu_kernel.paged_decode(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, 0.125, window)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_fp32_whole_row_passes_do_not_depend_on_the_batch():
    """A sequence's output is a function of its own rows: the same bits beside other sequences, or in
    another place of the batch (the per-tile sums are added in a fixed order)."""
    q, cache, meta = _decode_batch(torch.float32, 9, 3, 64, 64, 16, lens=[230, 7, 64, 500, 33, 129], seed=5)
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    full = cpu_kernel.paged_decode(q, cache.k, cache.v, tables, lens, 0.125)
    order = torch.tensor([3, 0, 5, 1])
    part = cpu_kernel.paged_decode(q[order].contiguous(), cache.k, cache.v, tables[order].contiguous(),
                                   lens[order].contiguous(), 0.125)
    assert torch.equal(part, full[order])


@pytest.mark.parametrize("d", [32, 64], ids=["d32", "d64-vector-path"])
@pytest.mark.parametrize("window,softcap", [(5, None), (64, None), (None, 30.0), (24, 50.0)])
def test_kernel_windows_and_softcap(window, softcap, d):
    q, cache, meta = _decode_batch(torch.float32, 8, 2, d, d, 4, lens=[3, 24, 25, 90])
    ref = decode_attention(q * 8, cache, meta, 0.2, window, softcap)  # large logits: soft-capping matters
    out = cpu_kernel.paged_decode(q * 8, cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, 0.2,
                                  window, softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)  # logits of ~50: fp32 rounding grows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [40], [300, 2], [17, 33, 15, 16, 1000]], ids=str)
def test_kernel_small_batches_split_kv_heads(dtype, lens):
    """Fewer sequences than twice the threads: work items are (sequence, KV head) pairs."""
    q, cache, meta = _decode_batch(dtype, 9, 3, 64, 64, 16, lens=lens, seed=3)
    ref = decode_attention(q, cache, meta, 0.125)
    out = cpu_kernel.paged_decode(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_kernel_rejects_indices_outside_the_pool():
    q, cache, meta = _decode_batch(torch.float32, 2, 1, 16, 16, 4, lens=[5, 9])
    bad = meta.decode_block_tables.clone()
    bad[1, 0] = cache.num_blocks
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernel.paged_decode(q, cache.k, cache.v, bad, meta.decode_seq_lens, 0.25)
    too_long = meta.decode_seq_lens + 100
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernel.paged_decode(q, cache.k, cache.v, meta.decode_block_tables, too_long, 0.25)


@pytest.mark.build
def test_without_the_kernel_auto_falls_back_and_cpu_is_refused(kernel_cache):
    code = (
        "from kvforge.attention import cpu_kernel, check_backend, describe_backend\n"
        "assert not cpu_kernel.available(), 'kernel should be disabled'\n"
        "check_backend('auto')\n"
        "print(describe_backend('auto', 'cpu'))\n"
        "try:\n    check_backend('cpu')\nexcept ValueError as e:\n    print(e)\n"
    )
    env = dict(os.environ, KVFORGE_CPU_KERNEL="0", KVFORGE_CACHE_DIR=str(kernel_cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "attention_backend 'cpu' is unavailable" in out and "KVFORGE_CPU_KERNEL=0" in out
    assert "sdpa (CPU decode kernel unavailable: disabled by KVFORGE_CPU_KERNEL=0)" in out


def test_startup_report_names_the_attention_and_linear_paths(tiny_model_factory):
    from kvforge import LLM

    path, _ = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, log_ledger=False)
    text = llm.engine.report.render()
    assert "attention" in text and "cpu (in-place C kernels: decode; prefill at head size 64, else SDPA" in text
    from kvforge.models.linear import ONEDNN_LINEAR

    assert "linear layers" in text and ("weights packed at load" in text) == ONEDNN_LINEAR
    # a bf16 model: the report names the bf16 prefill loop its panel kernel chose (AMX tiles where they run)
    text = LLM(model=path, dtype="bfloat16", log_ledger=False).engine.report.render()
    from kvforge.models import panel_linear as pl

    mode = pl.bf16_gemm_mode()
    assert ("bf16 prefill on AMX tiles" in text) == (mode == "amx" and cpu_kernel.bf16_amx())
    assert ("bf16 prefill on fp32 FMAs" in text) == (mode != "amx" and cpu_kernel.bf16_fma())
    if mode == "amx":
        assert "bf16 GEMM rows on AMX tiles" in text and "bf16 prefill on AMX tiles" in text


@pytest.mark.build
def test_kernel_builds_into_a_fresh_cache_dir(tmp_path):
    code = "from kvforge.attention import cpu_kernel\nprint(cpu_kernel.available(), cpu_kernel.unavailable_reason())\n"
    env = dict(os.environ, KVFORGE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "True", out
    assert list((tmp_path / "kernels").glob("paged_decode-*.so"))


def _prefill_batch(dtype, heads, kv_heads, block_size, specs, seed=0):
    """Chunks (start, new tokens) of different sequences in one step, blocks scattered in the pool."""
    from kvforge.attention.metadata import PrefillChunk

    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in specs) + 2
    cache = DenseKVCache(num_blocks, block_size, kv_heads, 64, 64, dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    chunks, row = [], 0
    for start, n in specs:
        nb = -(-(start + n) // block_size)
        chunks.append(PrefillChunk(slice(row, row + n), start, start + n, torch.tensor(ids[:nb])))
        ids, row = ids[nb:], row + n
    q = (torch.randn(row, heads, 64, generator=g) * 2).to(dtype)
    return q, cache, chunks


PREFILL_SPECS = [(0, 100), (37, 5), (0, 1), (200, 64), (15, 17)]  # first chunks, later chunks, 1-token chunk


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(9, 3, 16), (4, 4, 16), (16, 2, 5), (8, 1, 1)],
                         ids=["gqa", "mha", "8-per-group-bs5", "mqa-bs1"])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 5.0), (7, 3.0)],
                         ids=["causal", "window", "softcap", "window+softcap"])
def test_prefill_kernel_matches_reference(bf16_fma_restored, dtype, heads, kv_heads, block_size, window, softcap):
    from kvforge.attention.torch_ref import prefill_attention

    q, cache, chunks = _prefill_batch(dtype, heads, kv_heads, block_size, PREFILL_SPECS)
    assert cpu_kernel.prefill_supported(q, cache.k, cache.v)
    idx = cpu_kernel.prefill_indices(chunks, q.shape[0], cache.num_blocks, block_size)
    ref = torch.cat([prefill_attention(q, cache, c, 0.125, window, softcap) for c in chunks])
    outs = []
    # bf16: VDPBF16PS, then fp32 FMAs on the widened operands, then AMX tiles where they run
    paths = ("dot", "fma") + (("amx",) if cpu_kernel.set_bf16_amx(True) else ())
    for path in paths:
        cpu_kernel.set_bf16_fma(path == "fma")
        cpu_kernel.set_bf16_amx(path == "amx")
        out = torch.full_like(q, float("nan"))
        cpu_kernel.paged_prefill(q, cache.k, cache.v, idx, 0.125, window, softcap, out)
        # bf16: outputs of magnitude ~1-2 where one bf16 step is 0.008-0.016; the reference rounds its
        # probabilities to bf16, the kernel keeps them in fp32
        tol = {torch.float32: 2e-6, torch.bfloat16: 4e-2}[dtype]
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        outs.append(out)
    if dtype == torch.bfloat16:  # the bf16 paths differ only in sum order and P's rounding: a bf16 step or two
        for other in outs[1:]:
            torch.testing.assert_close(outs[0].float(), other.float(), atol=4e-2, rtol=2e-2)


@needs_prefill_kernel
def test_prefill_kernel_reach_and_index_checks():
    q, cache, chunks = _prefill_batch(torch.float32, 9, 3, 16, [(0, 20), (4, 8)])
    assert not cpu_kernel.prefill_supported(q[..., :32], cache.k[..., :32], cache.v[..., :32])  # head size 32
    assert not cpu_kernel.prefill_supported(q.half(), cache.k.half(), cache.v.half())  # fp16: SDPA's job
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernel.prefill_indices(chunks, q.shape[0] - 1, cache.num_blocks, 16)  # rows past the batch
    chunks[1].block_table[0] = cache.num_blocks
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernel.prefill_indices(chunks, q.shape[0], cache.num_blocks, 16)


@pytest.mark.parametrize("flags,prefill_kernel", [("-mno-avx512f", False), ("-mno-avx512bf16", True)],
                         ids=["no-avx512", "avx512-without-bf16"])
@pytest.mark.build
def test_kernels_for_other_cpus_build_and_match_the_reference(kernel_cache, flags, prefill_kernel):
    """CPUs without AVX-512 get the portable decode loops and SDPA prefill; AVX-512 CPUs without its
    bf16 instructions (Ice Lake) widen bf16 rows instead. Built here with those flags, both must
    compile, load and agree with the reference."""
    code = (
        "import torch, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_cpu_kernel import _decode_batch, _prefill_batch\n"
        "from kvforge.attention import cpu_kernel\n"
        "from kvforge.attention.torch_ref import decode_attention, prefill_attention\n"
        "from kvforge.models import fused\n"
        "assert cpu_kernel.available(), cpu_kernel.unavailable_reason()\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    q, cache, meta = _decode_batch(dtype, 9, 3, 64, 64, 16, lens=[1, 17, 100, 333])\n"
        "    ref = decode_attention(q, cache, meta, 0.125)\n"
        "    out = cpu_kernel.paged_decode(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, 0.125)\n"
        "    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)\n"
        "    q, cache, chunks = _prefill_batch(dtype, 9, 3, 16, [(0, 40), (7, 30)])\n"
        "    assert cpu_kernel.prefill_supported(q, cache.k, cache.v) == %r\n"
        "    if %r:\n"
        "        idx = cpu_kernel.prefill_indices(chunks, q.shape[0], cache.num_blocks, 16)\n"
        "        out = cpu_kernel.paged_prefill(q, cache.k, cache.v, idx, 0.125, None, None, torch.empty_like(q))\n"
        "        ref = torch.cat([prefill_attention(q, cache, c, 0.125) for c in chunks])\n"
        "        torch.testing.assert_close(out.float(), ref.float(), atol=4e-2, rtol=4e-2)\n"
        "x = torch.randn(4, 100)\n"
        "assert torch.equal(fused.argmax_rows(x), x.argmax(-1))\n"
        "print('ok')\n"
    ) % (os.path.dirname(__file__), prefill_kernel and HAS_AVX512, prefill_kernel and HAS_AVX512)
    env = dict(os.environ, KVFORGE_EXTRA_CFLAGS=flags, KVFORGE_CACHE_DIR=str(kernel_cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_library_for_one_group_serves_every_group(monkeypatch):
    """An engine's library has vector clones for its model's G alone (KVF_G_MASK): G = 3 takes them, and
    every other G the portable loops, decode giving the reference's results either way (a second model in
    the process is slower until its own library builds, never wrong); prefill is offered for G = 3 only."""
    from kvforge.attention.torch_ref import prefill_attention

    narrow = cpu_kernel.group_library(3)
    assert "-DKVF_G_MASK=0x4" in narrow.extra_flags and narrow is cpu_kernel.group_library(3)
    assert "-DKVF_G_MASK" not in " ".join(cpu_kernel.LIBRARY.extra_flags)  # the full build: every G
    assert narrow.load() is not None, narrow.error
    monkeypatch.setattr(cpu_kernel, "LIBRARY", narrow)  # every call below goes to the narrow build
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads in [(9, 3), (8, 4), (4, 4), (16, 2), (12, 1)]:
            q, cache, meta = _decode_batch(dtype, heads, kv_heads, 64, 64, 16, lens=[1, 17, 100, 333])
            ref = decode_attention(q, cache, meta, 0.125)
            out = cpu_kernel.paged_decode(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, 0.125)
            torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
        if HAS_AVX512:
            for heads, kv_heads in [(9, 3), (8, 4)]:
                q, cache, chunks = _prefill_batch(dtype, heads, kv_heads, 16, [(0, 40), (7, 30)])
                assert cpu_kernel.prefill_supported(q, cache.k, cache.v) == (heads // kv_heads == 3)
                if heads // kv_heads == 3:
                    idx = cpu_kernel.prefill_indices(chunks, q.shape[0], cache.num_blocks, 16)
                    out = torch.full_like(q, float("nan"))
                    cpu_kernel.paged_prefill(q, cache.k, cache.v, idx, 0.125, None, None, out)
                    ref = torch.cat([prefill_attention(q, cache, c, 0.125, None, None) for c in chunks])
                    tol = {torch.float32: 1e-5, torch.bfloat16: 4e-2}[dtype]  # fp32: summation order only
                    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_the_engine_asks_for_its_models_group():
    from kvforge.engine.engine import attention_group

    assert attention_group({"num_attention_heads": 9, "num_key_value_heads": 3}) == 3
    assert attention_group({"num_attention_heads": 8}) == 1  # no KV head count: MHA
    assert attention_group({"text_config": {"num_attention_heads": 8, "num_key_value_heads": 2}}) == 4
    assert attention_group({"num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512}) == 16
    assert attention_group({}) is None
    assert cpu_kernel.group_mask(3) == 0b100 and cpu_kernel.group_mask(16) == 0 and cpu_kernel.group_mask(None) == 0xFF
