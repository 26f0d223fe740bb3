"""The panel linear kernels equal F.linear for any M, N, K: fp32 (fp32 rounding) with and without AVX2, bf16
(one bf16 rounding of an fp32 sum) with and without AVX512-BF16; `KVFORGE_LINEAR` picks them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvforge.models import panel_linear as pl

pytestmark = pytest.mark.skipif(not pl.available(), reason=f"no panel kernel: {pl.unavailable_reason()}")


def _check(m: int, n: int, k: int, bias: bool, threads: int | None = None) -> None:
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    out = pl.panel_linear(x, pl.pack_panels(w), b, num_threads=threads)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    # each output is a K-term dot product: its fp32 error scales with sqrt(K) * |x| * |w|
    scale = (x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())).clamp_min(1.0)
    err = ((out.double() - ref).abs() / scale).max().item()
    assert out.shape == (m, n) and err < 1e-6, (m, n, k, bias, err)


def test_matches_f_linear_for_odd_shapes_all_row_counts():
    torch.manual_seed(0)
    for m in range(1, 71):
        n, k = (1, 3, 15, 16, 17, 33, 47)[m % 7], (1, 7, 8, 9, 64, 100, 131)[m % 7 - 3]
        _check(m, n, k, bias=m % 2 == 0)


def test_model_shapes_and_thread_counts():
    torch.manual_seed(1)
    for m in (1, 2, 3, 4, 6, 13, 64, 200):
        _check(m, 960, 576, bias=True, threads=2)
        _check(m, 200, 1536, bias=False, threads=1)
    _check(1, 40, 576, bias=False, threads=64)  # more threads than panels


def test_large_m_crosses_row_blocks():
    torch.manual_seed(2)
    _check(1030, 50, 576, bias=True)  # x rows exceed one L2 block of 54 rows
    _check(300, 70, 4096, bias=False)  # a block holds just MR rows
    _check(13, 20, 700, bias=True)  # K cut in blocks of 256 with a 188 remainder


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the AVX-512 GEMM tiles")
def test_gemm_rows_do_not_depend_on_their_tile():
    """AVX-512 GEMM rows are copied into tiles of 8 (14 for 9-14 rows) interleaved rows, the last one padded: a row's
    output is the same bits whichever tile and slot it lands in, and whatever rows share its tile or call,
    down to a call of one row (the AVX2 tiles treat 1-3 rows as decode rows, which sum in another order)."""
    torch.manual_seed(3)
    # 9-14 rows take the 14-row wide tile and 15-32 rows spread their prefetches as runs: same bits
    for m, k, n in ((37, 131, 70), (5, 9, 16), (300, 576, 50), (14, 131, 70), (10, 576, 33), (15, 64, 49)):
        x, w = torch.randn(m, k), pl.pack_panels(torch.randn(n, k))
        perm = torch.randperm(m)
        full = pl.panel_linear(x, w)
        assert torch.equal(pl.panel_linear(x[perm], w), full[perm])
        assert torch.equal(pl.panel_linear(x[: m - 1], w), full[: m - 1])  # one row fewer: other padding
        # decode rows (1-3) take the same tiles: a row alone gives the bits it gives inside a batch
        for i in (0, m // 2, m - 1):
            assert torch.equal(pl.panel_linear(x[i : i + 1], w), full[i : i + 1])
        assert torch.equal(pl.panel_linear(x[:3], w), full[:3])


def test_leading_dims_and_bad_input():
    w = pl.pack_panels(torch.randn(5, 8))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(pl.panel_linear(x, w), F.linear(x, _dense(w)))
    assert pl.panel_linear(torch.randn(0, 8), w).shape == (0, 5)
    with pytest.raises(ValueError, match="last dim 8"):
        pl.panel_linear(torch.randn(2, 7), w)
    with pytest.raises(ValueError, match="float32"):
        pl.panel_linear(torch.randn(2, 8, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="bias"):
        pl.panel_linear(torch.randn(2, 8), w, torch.randn(4))
    with pytest.raises(ValueError, match="2-D fp32 or bf16"):
        pl.pack_panels(torch.randn(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="bfloat16"):  # x must be in the weight's dtype
        pl.panel_linear(torch.randn(2, 8), pl.pack_panels(torch.randn(5, 8, dtype=torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_is_written_in_place_and_checked(dtype):
    """`out=` (benchmarks timing the multiply alone) gets the bits a fresh output would, and a wrong shape,
    dtype or layout is refused before anything is written."""
    w = pl.pack_panels(torch.randn(37, 24).to(dtype))
    x, b = torch.randn(2, 3, 24).to(dtype), torch.randn(37).to(dtype)
    out = torch.full((6, 37), float("nan"), dtype=dtype)
    y = pl.panel_linear(x, w, b, out=out)
    assert y.data_ptr() == out.data_ptr() and y.shape == (2, 3, 37)
    assert torch.equal(y, pl.panel_linear(x, w, b))
    for bad in (torch.empty(6, 36, dtype=dtype), torch.empty(6, 37, dtype=torch.float16),
                torch.empty(37, 6, dtype=dtype).t()):
        with pytest.raises(ValueError, match="out must be"):
            pl.panel_linear(x, w, out=bad)


def _dense(pw: pl.PanelWeight) -> torch.Tensor:
    """Undo the packing: the packed bytes hold exactly the weight plus zero padding."""
    panels, k, nr = pw.packed.shape
    full = pw.packed.transpose(1, 2).reshape(panels * nr, k)
    assert torch.count_nonzero(full[pw.n:]) == 0
    return full[:pw.n]


def test_packing_is_a_relayout():
    w = torch.randn(37, 19)
    pw = pl.pack_panels(w)
    assert torch.equal(_dense(pw), w) and pw.nbytes == 48 * 19 * 4


def _run_built_with(flags: str, cache, body: str, simd: bool = False) -> None:
    """Run `body` (test code) in a fresh process whose kernels are built with KVFORGE_EXTRA_CFLAGS=flags; with
    flags, the kernel must say it took its plain-C path, or with `simd` its SIMD one (`body` prints 'simd N')."""
    code = "import sys, torch; sys.path.insert(0, %r)\n" % os.path.dirname(__file__) + body + "print('ok')\n"
    env = dict(os.environ, KVFORGE_EXTRA_CFLAGS=flags, KVFORGE_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[-1] == "ok", out.stderr[-2000:]
    if flags:
        assert f"simd {int(simd)}" in out.stdout


@pytest.mark.build
@pytest.mark.parametrize("flags", ["-mno-avx2 -mno-fma", "-mno-avx512f", ""])
def test_plain_c_fallback_build(kernel_cache, flags):
    """Built without AVX2/FMA the kernel takes its plain-C path (and says so) with the same results; built
    without AVX-512 (an AVX2 CPU) its AVX2 tiles serve every row count."""
    _run_built_with(flags, kernel_cache, (
        "from test_panel_linear import _check\n"
        "from kvforge.models import panel_linear as pl\n"
        "assert pl.available(), pl.unavailable_reason()\n"
        "print('simd', pl.LIBRARY.load().kvf_panel_simd())\n"
        "torch.manual_seed(3)\n"
        "for m in (1, 2, 3, 5, 6, 7, 70):\n"
        "    _check(m, 33, 131, bias=m & 1 == 1)\n"
        "_check(64, 960, 576, bias=True, threads=2)\n"
    ), simd=flags == "-mno-avx512f")


def _check_bf16(m: int, n: int, k: int, bias: bool, threads: int | None = None) -> None:
    """bf16 x and W, fp32 accumulation, one rounding to bf16: within a bf16 step of the exact result."""
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    out = pl.panel_linear(x, pl.pack_panels(w), b, num_threads=threads)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = (x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())).clamp_min(1.0)
    err = ((out.double() - ref).abs() / scale).max().item()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and err < 2 ** -8, (m, n, k, bias, err)


def _dense_bf16(pw: pl.PanelWeight) -> torch.Tensor:
    panels, k2, nr, two = pw.packed.shape
    full = pw.packed.transpose(1, 2).reshape(panels * nr, k2 * two)
    assert torch.count_nonzero(full[pw.n:].float()) == 0 and torch.count_nonzero(full[:, pw.k:].float()) == 0
    return full[:pw.n, :pw.k]


bf16_kernel = pytest.mark.skipif(not pl.available(torch.bfloat16),
                                 reason=f"no bf16 panel kernel: {pl.unavailable_reason(torch.bfloat16)}")


@pytest.fixture(params=["dot", "fma", "amx"])
def bf16_gemm(request):
    """Each bf16 GEMM tile in turn (`KVFORGE_BF16_GEMM`), whatever this CPU's measured choice is."""
    lib = pl.LIBRARY_BF16.load()
    if lib is None or not lib.kvf_panel_bf16_simd():
        pytest.skip("the bf16 kernel's GEMM tiles need AVX512-BF16")
    if request.param == "amx" and not lib.kvf_panel_bf16_amx():
        pytest.skip("no AMX tiles on this CPU (or Linux refused the tile state)")
    before = lib.kvf_panel_bf16_gemm_mode()
    lib.kvf_panel_bf16_set_gemm_mode(pl.BF16_GEMM_MODES[request.param])
    assert pl.bf16_gemm_mode() == request.param
    yield request.param
    lib.kvf_panel_bf16_set_gemm_mode(before)


@bf16_kernel
def test_bf16_kernel_matches_f_linear_for_odd_shapes(bf16_gemm):
    torch.manual_seed(5)
    # 1-4 rows: the decode tiles; 5 up: GEMM tiles of 8 rows x 3 panels, with every remainder of rows
    # (m % 8) and of panels (ceil(n / 16) % 3) in turn
    for m in range(1, 30):
        n, k = (1, 15, 16, 17, 33, 47, 80)[m % 7], (1, 7, 8, 9, 64, 131)[m % 6 - 2]  # odd K: a zero k is padded
        _check_bf16(m, n, k, bias=m % 2 == 0)
    for m in (1, 2, 4, 5, 8, 13, 64, 200):
        _check_bf16(m, 960, 576, bias=True, threads=2)
        _check_bf16(m, 200, 1537, bias=False, threads=1)
    _check_bf16(1, 40, 576, bias=False, threads=64)  # more threads than panels
    _check_bf16(9, 40, 576, bias=True, threads=64)


@bf16_kernel
def test_bf16_gemm_tiles_on_whole_k_blocks(bf16_gemm):
    """K a multiple of 32 (the AMX tiles' k block: every shape of the default model): every remainder of
    16-row tiles (m % 16, m % 32), odd and even panel counts (two panels a step), row chunks past 256,
    one and two threads, with and without bias; K not a multiple of 32 takes the vector tiles instead."""
    torch.manual_seed(11)
    for i, m in enumerate((5, 15, 16, 17, 31, 32, 33, 48, 63, 100, 300)):
        n, k = (16, 17, 33, 47, 80, 200)[i % 6], (32, 64, 96, 576)[i % 4]
        _check_bf16(m, n, k, bias=i % 2 == 0, threads=1 + i % 2)
    _check_bf16(40, 48, 80, bias=True, threads=2)  # 40 k-pairs: not whole blocks of 16


@bf16_kernel
def test_bf16_gemm_tiles_agree_within_one_rounding(bf16_gemm):
    """Both GEMM tiles take exact products and fp32 sums (in different orders): against the fp64 truth each
    is within half a bf16 step plus the fp32 sum's error, on the model's shapes and 5-64 rows. A tile that
    dropped or swapped the odd k of a pair, or a row of the widened x, is off by whole units."""
    torch.manual_seed(9)
    for m, (n, k) in zip((5, 8, 13, 32, 64), ((960, 576), (576, 1536), (3072, 576), (200, 131), (47, 64))):
        x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        out = pl.panel_linear(x, pl.pack_panels(w), num_threads=2).double()
        ref = x.double() @ w.double().T
        ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref)[1] - 8)  # one bf16 step at |ref|
        slack = (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -24  # fp32 summation error bound
        assert ((out - ref).abs() <= 0.5 * ulp + slack).all(), (bf16_gemm, m, n, k)


def test_bf16_gemm_switch_rejects_unknown_values():
    """A bad KVFORGE_BF16_GEMM stops the bf16 kernel's load with an error naming the switch and its choices."""
    env = dict(os.environ, KVFORGE_BF16_GEMM="fast", PYTHONPATH=os.pathsep.join(sys.path))
    code = "import torch\nfrom kvforge.models import panel_linear as pl\npl.available(torch.bfloat16)\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "KVFORGE_BF16_GEMM must be one of auto, dot, fma, amx, got 'fast'" in proc.stderr


@pytest.mark.build
@bf16_kernel
def test_bf16_gemm_amx_where_it_cannot_run_is_an_error_naming_why(kernel_cache):
    """KVFORGE_BF16_GEMM=amx with a build that has no AMX path (`-mno-amx-tile`, as on every CPU without
    AMX) stops the bf16 kernel's load with an error that says why and what to use instead."""
    env = dict(os.environ, KVFORGE_BF16_GEMM="amx", KVFORGE_EXTRA_CFLAGS="-mno-amx-tile",
               KVFORGE_CACHE_DIR=str(kernel_cache), PYTHONPATH=os.pathsep.join(sys.path))
    code = "import torch\nfrom kvforge.models import panel_linear as pl\npl.available(torch.bfloat16)\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "KVFORGE_BF16_GEMM=amx, but AMX tiles cannot run here" in proc.stderr and "use auto, dot or fma" in proc.stderr


@bf16_kernel
def test_bf16_gemm_choice_carries_to_prefill_attention(tmp_path):
    """The bf16 prefill attention follows the GEMM rows' choice: `fma` keeps it off the AMX tiles and on
    FMAs; `auto` puts it on AMX exactly where the GEMM rows run there."""
    code = ("import torch\nfrom kvforge.models import panel_linear as pl\nfrom kvforge.attention import cpu_kernel\n"
            "pl.available(torch.bfloat16)\nprint(pl.bf16_gemm_mode(), cpu_kernel.bf16_amx(), cpu_kernel.bf16_fma())\n")
    seen = {}
    for choice in ("fma", "auto"):
        env = dict(os.environ, KVFORGE_BF16_GEMM=choice, PYTHONPATH=os.pathsep.join(sys.path))
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen[choice] = proc.stdout.split()
    if seen["fma"][0] != "None":  # the AVX512-BF16 path is built
        assert seen["fma"] == ["fma", "False", "True"]
        assert (seen["auto"][0] == "amx") == (seen["auto"][1] == "True")


@bf16_kernel
def test_bf16_rounding_is_round_to_nearest_even_in_every_tile():
    """The GEMM tiles round in registers, the decode tiles per element: the same bits either way (one row
    of a batch gives what it gives alone), NaN and infinities included."""
    torch.manual_seed(8)
    w = torch.randn(70, 64).bfloat16()
    x = torch.randn(11, 64).bfloat16()
    x[3, 5] = float("nan")
    x[7] = x[7] * 1e38  # overflows to inf in fp32 sums
    pw = pl.pack_panels(w)
    many = pl.panel_linear(x, pw, num_threads=1)
    for r in range(11):
        alone = pl.panel_linear(x[r:r + 1], pw, num_threads=1)
        assert torch.equal(many[r].float().nan_to_num(), alone[0].float().nan_to_num()) or r in (3, 7), r
    assert many[3].float().isnan().all() and torch.isinf(many[7].float()).any()


@bf16_kernel
def test_bf16_packing_is_a_relayout():
    w = torch.randn(37, 19).bfloat16()
    pw = pl.pack_panels(w)
    assert torch.equal(_dense_bf16(pw), w) and pw.nbytes == 48 * 20 * 2 and pw.dtype == torch.bfloat16


@pytest.mark.build
@bf16_kernel
@pytest.mark.parametrize("flags", ["-mno-avx512bf16", ""])
def test_bf16_plain_c_fallback_build(kernel_cache, flags):
    """Built without AVX512-BF16 the bf16 kernel takes its plain-C path (and says so) with the same results."""
    _run_built_with(flags, kernel_cache, (
        "from test_panel_linear import _check_bf16\n"
        "from kvforge.models import panel_linear as pl\n"
        "assert pl.available(torch.bfloat16), pl.unavailable_reason(torch.bfloat16)\n"
        "print('simd', int(pl.simd(torch.bfloat16)))\n"
        "torch.manual_seed(6)\n"
        "for m in (1, 2, 3, 4, 5, 9):\n"
        "    _check_bf16(m, 33, 131, bias=m & 1 == 1)\n"
    ))


def test_both_sends_decode_rows_to_the_panel_kernel_and_larger_calls_to_onednn(monkeypatch):
    """KVFORGE_LINEAR=both: two layouts per weight, each counted; <= PANEL_DECODE_ROWS rows run the panel
    kernel, more rows oneDNN; the results agree with the dense layer either way."""
    from torch import nn

    from kvforge.engine.startup_report import _describe_linear, weights_bytes
    from kvforge.models import linear

    if not linear.ONEDNN_LINEAR:
        pytest.skip("oneDNN linear unavailable on this torch build")
    monkeypatch.setenv("KVFORGE_LINEAR", "both")
    torch.manual_seed(7)
    layer = linear.Linear(24, 40)
    model = nn.ModuleList([layer])
    size = weights_bytes(model)
    xs = [torch.randn(m, 24) for m in (1, linear.PANEL_DECODE_ROWS, linear.PANEL_DECODE_ROWS + 1, 64)]
    with torch.no_grad():
        before = [layer(x) for x in xs]
        assert linear.pack_linear_weights(model) == 1
        assert layer.panel_weight is not None and layer.onednn_weight is not None
        assert layer.decode_nbytes == 48 * 24 * 4  # decode rows read the panel layout
        calls = []
        real = linear.panel_linear
        monkeypatch.setattr(linear, "panel_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
        for x, ref in zip(xs, before):
            torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    assert calls == [1, linear.PANEL_DECODE_ROWS]
    # the oneDNN layout replaces the dense weight (same bytes); the panel layout is extra, padded to 48 columns
    assert weights_bytes(model) == size + 48 * 24 * 4
    assert "KVFORGE_LINEAR=both" in _describe_linear(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvforge_linear_panel_packs_the_tied_lm_head_in_place_and_the_embedding_reads_its_panels(monkeypatch, dtype):
    """A tied lm_head in the panel layout keeps no dense copy: the embedding table reads its rows out of the
    panels, bitwise the dense rows, and the weights are counted once (padded to whole panels)."""
    from torch import nn

    from kvforge.engine.startup_report import _describe_linear, weights_bytes
    from kvforge.models.linear import Linear, PanelEmbedding, pack_linear_weights

    if not (pl.available(dtype) and pl.simd(dtype)):
        pytest.skip(f"no SIMD panel kernel for {dtype} on this CPU")
    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    torch.manual_seed(4)
    emb = nn.Embedding(50, 23).to(dtype)  # odd K: bf16 panels pad a zero k
    tied = Linear(23, 50, bias=False).to(dtype)
    tied.weight = emb.weight
    model = nn.ModuleList([emb, Linear(23, 40).to(dtype), tied])
    x = torch.randn(3, 23).to(dtype)
    ids = torch.tensor([[0, 7, 49], [16, 15, 33]])
    with torch.no_grad():
        before, rows = [model[1](x), tied(x)], emb(ids)
        size = weights_bytes(model)
        assert pack_linear_weights(model, copy_shared=True) == 2
        assert isinstance(model[0], PanelEmbedding) and model[0].panel_weight is tied.panel_weight
        assert not tied.packed_copy and tied.weight.numel() == 0 and model[1].weight.numel() == 0
        assert torch.equal(model[0](ids), rows)
        for a, b in zip(before, [model[1](x), tied(x)]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    pad_k = 23 + 23 % 2 if dtype == torch.bfloat16 else 23  # panels of 16 columns: 50 -> 64, 40 -> 48
    el = torch.finfo(dtype).bits // 8
    assert weights_bytes(model) == size - 50 * 23 * el + 64 * pad_k * el + (48 * pad_k - 40 * 23) * el
    assert "packed copy" not in _describe_linear(model)


def test_a_tied_weight_without_a_panel_kernel_for_its_dtype_keeps_the_tables_dense_rows(monkeypatch):
    """Where the panel kernel is not built for the dtype (bf16 without AVX512-BF16), the tied lm_head takes
    oneDNN's layout as a copy and the embedding keeps reading its dense rows."""
    from torch import nn

    from kvforge.models import linear
    from kvforge.models.linear import Linear, pack_linear_weights

    if torch.bfloat16 not in linear.PACKABLE_DTYPES or not linear.ONEDNN_LINEAR:
        pytest.skip("oneDNN cannot pack bf16 here")
    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    monkeypatch.setattr(linear, "panel_kernel_simd", lambda dtype=torch.float32: dtype != torch.bfloat16)
    emb = nn.Embedding(48, 32).to(torch.bfloat16)
    tied = Linear(32, 48, bias=False).to(torch.bfloat16)
    tied.weight = emb.weight
    model = nn.ModuleList([emb, tied])
    ids, x = torch.tensor([3, 47]), torch.randn(2, 32).to(torch.bfloat16)
    with torch.no_grad():
        rows, before = emb(ids), tied(x)
        assert pack_linear_weights(model, copy_shared=True) == 1
        assert model[0] is emb and tied.weight is emb.weight and tied.packed_copy
        assert tied.panel_weight is None and tied.onednn_weight is not None
        assert torch.equal(emb(ids), rows)
        torch.testing.assert_close(tied(x), before, atol=1e-2, rtol=1e-2)


def test_a_tied_weight_whose_other_holder_is_not_an_embedding_keeps_a_packed_copy(monkeypatch):
    from torch import nn

    from kvforge.engine.startup_report import weights_bytes
    from kvforge.models.linear import Linear, pack_linear_weights

    class Shard(nn.Module):  # e.g. a tensor-parallel vocabulary shard: it reads the dense weight its own way
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    tied = Linear(24, 50, bias=False)
    model = nn.ModuleList([Shard(tied.weight), tied])
    size = weights_bytes(model)
    assert pack_linear_weights(model, copy_shared=True) == 1
    assert tied.packed_copy and tied.weight is model[0].weight and tied.panel_weight is not None
    assert weights_bytes(model) == size + 64 * 24 * 4


def test_kvforge_linear_rejects_unknown_backend(monkeypatch):
    from kvforge.models.linear import Linear

    monkeypatch.setenv("KVFORGE_LINEAR", "fast")
    with pytest.raises(ValueError, match="KVFORGE_LINEAR must be one of auto, onednn, panel, both"):
        Linear(4, 4).pack()


def test_auto_takes_the_panel_kernel_where_its_simd_path_is_built(monkeypatch):
    """auto: panel wherever the fp32 kernel's SIMD path is built (AVX2 and AVX-512 CPUs alike: one layout,
    GEMM tiles for many rows); oneDNN for a plain-C build."""
    from kvforge.models import linear

    monkeypatch.delenv("KVFORGE_LINEAR", raising=False)
    monkeypatch.setattr(linear, "panel_kernel_available", lambda *a: True)
    monkeypatch.setattr(linear, "panel_kernel_simd", lambda *a: True)
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert linear.linear_backend() == "panel"
    monkeypatch.setattr(linear, "panel_kernel_simd", lambda *a: False)  # plain-C build: oneDNN is faster
    assert linear.linear_backend() == "onednn"
    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    assert linear.linear_backend() == "panel"


def test_both_keeps_onednn_alone_where_a_panel_kernel_has_no_simd_path(monkeypatch):
    """A plain-C panel kernel would be slower than oneDNN: under `both` such weights get oneDNN's layout only."""
    from kvforge.models import linear

    if not linear.ONEDNN_LINEAR:
        pytest.skip("oneDNN linear unavailable on this torch build")
    monkeypatch.setattr(linear, "panel_kernel_simd", lambda *a: False)
    layer = linear.Linear(24, 40)
    assert layer.pack(backend="both")
    assert layer.panel_weight is None and layer.onednn_weight is not None


@bf16_kernel
def test_ledger_names_the_bf16_gemm_tile_in_use(monkeypatch, bf16_gemm):
    from torch import nn

    from kvforge.engine.startup_report import _describe_linear
    from kvforge.models import linear

    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    model = nn.ModuleList([linear.Linear(64, 48).to(torch.bfloat16)])
    assert linear.pack_linear_weights(model) == 1
    assert f"KVFORGE_BF16_GEMM={bf16_gemm}" in _describe_linear(model)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the AVX-512 GEMM tiles")
def test_gated_gemm_is_bitwise_the_matmul_then_silu_mul():
    """`panel_linear_silu_mul` (gate|up matmul and SiLU-and-multiply in one call) gives the bits of
    `panel_linear` then `fused.silu_mul` (each held to its own reference by other tests), at decode and prefill
    row counts, odd K and several widths; where it
    cannot fuse (I not whole panels, a dtype it does not take) it says so with None."""
    from kvforge.models import fused

    torch.manual_seed(5)
    for m, k, inter in ((1, 576, 1536), (9, 64, 48), (14, 100, 16), (17, 576, 80), (33, 131, 1536),
                        (300, 576, 1536), (1030, 64, 32)):
        x, w = torch.randn(m, k), pl.pack_panels(torch.randn(2 * inter, k))
        h = pl.panel_linear_silu_mul(x, w)
        assert h is not None and h.shape == (m, inter)
        ref = fused.silu_mul(pl.panel_linear(x, w))
        assert torch.equal(h, ref), (m, k, inter, (h - ref).abs().max().item())
    assert pl.panel_linear_silu_mul(torch.randn(3, 8), pl.pack_panels(torch.randn(2 * 24, 8))) is None  # I = 24
    assert pl.panel_linear_silu_mul(torch.randn(3, 8).half(), pl.pack_panels(torch.randn(64, 8).bfloat16())) is None


@pytest.mark.skipif(not pl.simd(torch.bfloat16), reason="the AVX512-BF16 GEMM tiles")
@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_bf16_gated_gemm_is_bitwise_the_matmul_then_silu_mul(mode: str):
    """The bf16 gate|up matmul and SiLU-and-multiply in one call (`kvf_panel_linear_bf16_silu_mul`, which never
    writes the 2I-wide product out) gives the bits of `panel_linear` then `fused.silu_mul`, on both vector
    tiles, at decode and prefill row counts (whole and partial 8-row tiles, 1-3 panels a thread's last group)
    and several widths; where it cannot fuse (odd K, I not whole panels) it says so with None."""
    from kvforge.models import fused

    lib = pl.LIBRARY_BF16.load()
    before = lib.kvf_panel_bf16_gemm_mode()
    if lib.kvf_panel_bf16_set_gemm_mode(pl.BF16_GEMM_MODES[mode]) != pl.BF16_GEMM_MODES[mode]:
        pytest.skip(f"the {mode} tile cannot be forced here")
    try:
        torch.manual_seed(6)
        for m, k, inter in ((1, 576, 1536), (4, 64, 48), (9, 64, 48), (17, 576, 80), (33, 130, 1536),
                            (300, 576, 1536), (1030, 64, 32)):
            x, w = torch.randn(m, k).bfloat16(), pl.pack_panels(torch.randn(2 * inter, k).bfloat16())
            h = pl.panel_linear_silu_mul(x, w)
            assert h is not None and h.shape == (m, inter) and h.dtype == torch.bfloat16
            ref = fused.silu_mul(pl.panel_linear(x, w))
            assert torch.equal(h, ref), (m, k, inter, (h.float() - ref.float()).abs().max().item())
        bf = torch.bfloat16
        assert pl.panel_linear_silu_mul(torch.randn(3, 8, dtype=bf), pl.pack_panels(torch.randn(48, 8, dtype=bf))) is None
        assert pl.panel_linear_silu_mul(torch.randn(3, 9, dtype=bf), pl.pack_panels(torch.randn(64, 9, dtype=bf))) is None
    finally:
        lib.kvf_panel_bf16_set_gemm_mode(before)



@pytest.mark.skipif(not pl.simd(torch.bfloat16), reason="the AVX512-BF16 GEMM tiles")
@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_bf16_gemm_k_chunks_give_the_bits_of_one_pass(mode: str):
    """Past KVF_GEMM_KC k-pairs the vector GEMM tiles run K in chunks at up to 64 rows (so a panel group and
    the next one fit in L2), keeping each row tile's fp32 sums between chunks: every chunking, even and uneven, one and two
    threads, with bias, and the gated gate|up call, gives the bits of one pass over K. And the default
    chunking of a long K is right against the fp64 truth."""
    from kvforge.models import fused

    lib = pl.LIBRARY_BF16.load()
    before = lib.kvf_panel_bf16_gemm_mode()
    if lib.kvf_panel_bf16_set_gemm_mode(pl.BF16_GEMM_MODES[mode]) != pl.BF16_GEMM_MODES[mode]:
        pytest.skip(f"the {mode} tile cannot be forced here")
    kc_before = lib.kvf_panel_bf16_set_kc(-1)
    try:
        torch.manual_seed(12)
        for i, (m, n, k) in enumerate(((1, 80, 130), (5, 47, 577), (9, 200, 2050), (17, 33, 64), (33, 96, 1030),
                                       (64, 48, 130), (200, 48, 130))):  # 200 rows: a prefill, one pass
            x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
            pw, threads = pl.pack_panels(w), 1 + i % 2
            lib.kvf_panel_bf16_set_kc(0)  # one pass
            ref = pl.panel_linear(x, pw, b, num_threads=threads)
            for kc in (1, 7, 64, 300):
                lib.kvf_panel_bf16_set_kc(kc)
                out = pl.panel_linear(x, pw, b, num_threads=threads)
                assert torch.equal(out, ref), (m, n, k, kc, (out.float() - ref.float()).abs().max().item())
        for m, k, inter in ((1, 130, 48), (9, 576, 80), (33, 2050, 48)):
            x, w = torch.randn(m, k).bfloat16(), pl.pack_panels(torch.randn(2 * inter, k).bfloat16())
            lib.kvf_panel_bf16_set_kc(0)
            ref = pl.panel_linear_silu_mul(x, w)
            for kc in (3, 64):
                lib.kvf_panel_bf16_set_kc(kc)
                assert torch.equal(pl.panel_linear_silu_mul(x, w), ref), (m, k, inter, kc)
        lib.kvf_panel_bf16_set_kc(-1)  # the default: K = 4,100 in three chunks
        for m in (1, 12, 40):
            _check_bf16(m, 64, 4100, bias=True, threads=2)
    finally:
        lib.kvf_panel_bf16_set_kc(kc_before)
        lib.kvf_panel_bf16_set_gemm_mode(before)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the AVX-512 GEMM tiles")
def test_gated_mlp_takes_the_one_call_on_fp32_panel_weights(monkeypatch):
    """A packed fp32 `GatedMLP` runs its gate|up matmul and SiLU-and-multiply as one call, with the bits of
    the two calls it falls back to where the one call cannot run (here: made to decline)."""
    from kvforge.models import linear as lin
    from kvforge.models.layers import GatedMLP

    torch.manual_seed(6)
    mlp = GatedMLP(64, 96)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        assert layer.pack(backend="panel")
    x = torch.randn(40, 64)
    calls = []
    real = lin.panel_linear_silu_mul
    monkeypatch.setattr(lin, "panel_linear_silu_mul", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fused_out = mlp(x)
        assert calls, "the gated call was not taken"
        monkeypatch.setattr(lin, "panel_linear_silu_mul", lambda *a, **k: None)
        assert mlp.gate_up_proj.silu_mul(x) is None
        two_calls = mlp(x)
    assert torch.equal(fused_out, two_calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 40), (48, 37), (50, 40)])
def test_packing_in_place_gives_the_same_panels_in_the_weights_own_memory(dtype, n, k):
    """`pack_panels(in_place=True)` re-lays whole panels out inside the weight (no second copy alive at load);
    where panels do not fill it exactly (N not whole panels; bf16: odd K) it copies, as without."""
    if not pl.available(dtype):
        pytest.skip(f"no panel kernel for {dtype}")
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(dtype)
    want = pl.pack_panels(w.clone())
    got = pl.pack_panels(w, in_place=True)
    assert torch.equal(got.packed, want.packed) and (got.n, got.k) == (n, k)
    fits = n % want.packed.shape[2] == 0 and (dtype == torch.float32 or k % 2 == 0)  # panel width: 16 here
    assert (got.packed.data_ptr() == w.data_ptr()) == fits
    x = torch.randn(3, k).to(dtype)
    assert torch.equal(pl.panel_linear(x, got), pl.panel_linear(x, want))
