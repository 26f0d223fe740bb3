"""The panel fp32 linear kernel equals F.linear (fp32 rounding) for any M, N, K, with and without AVX2."""
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


def test_leading_dims_and_bad_input():
    w = pl.pack_panels(torch.randn(5, 8))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(pl.panel_linear(x, w), F.linear(x, _dense(w)))
    assert pl.panel_linear(torch.randn(0, 8), w).shape == (0, 5)
    with pytest.raises(ValueError, match="last dim 8"):
        pl.panel_linear(torch.randn(2, 7), w)
    with pytest.raises(ValueError, match="fp32"):
        pl.panel_linear(torch.randn(2, 8, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="bias"):
        pl.panel_linear(torch.randn(2, 8), w, torch.randn(4))
    with pytest.raises(ValueError, match="2-D fp32"):
        pl.pack_panels(torch.randn(4, 4, dtype=torch.bfloat16))


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


@pytest.mark.parametrize("flags", ["-mno-avx2 -mno-fma", ""])
def test_plain_c_fallback_build(tmp_path, flags):
    """Built without AVX2/FMA the kernel takes its plain-C path (and says so) with the same results."""
    code = (
        "import sys, torch; sys.path.insert(0, %r)\n"
        "from test_panel_linear import _check\n"
        "from kvforge.models import panel_linear as pl\n"
        "assert pl.available(), pl.unavailable_reason()\n"
        "print('simd', pl.LIBRARY.load().kvf_panel_simd())\n"
        "torch.manual_seed(3)\n"
        "for m in (1, 2, 3, 5, 6, 7, 70):\n"
        "    _check(m, 33, 131, bias=m & 1 == 1)\n"
        "_check(64, 960, 576, bias=True, threads=2)\n"
        "print('ok')\n"
    ) % os.path.dirname(__file__)
    env = dict(os.environ, KVFORGE_EXTRA_CFLAGS=flags, KVFORGE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[-1] == "ok", out.stderr[-2000:]
    if flags:
        assert "simd 0" in out.stdout


def test_kvforge_linear_panel_packs_fp32_layers_and_the_tied_copy(monkeypatch):
    from torch import nn

    from kvforge.engine.startup_report import weights_bytes
    from kvforge.models.linear import Linear, pack_linear_weights

    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    torch.manual_seed(4)
    emb = nn.Embedding(50, 24)
    tied = Linear(24, 50, bias=False)
    tied.weight = emb.weight
    model = nn.ModuleList([emb, Linear(24, 40), tied, Linear(24, 8).to(torch.bfloat16)])
    x = torch.randn(3, 24)
    with torch.no_grad():
        before = [model[1](x), tied(x)]
        size = weights_bytes(model)
        assert pack_linear_weights(model, copy_shared=True) >= 2
        assert model[1].panel_weight is not None and tied.panel_weight is not None and tied.packed_copy
        assert model[3].panel_weight is None  # bf16 stays with oneDNN (or dense)
        assert model[1].weight.numel() == 0 and tied.weight is emb.weight
        for a, b in zip(before, [model[1](x), tied(x)]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the tied copy is extra bytes, padded to whole panels of 16 columns (50 -> 64)
    assert weights_bytes(model) == size + 64 * 24 * 4 + (48 - 40) * 24 * 4


def test_kvforge_linear_rejects_unknown_backend(monkeypatch):
    from kvforge.models.linear import Linear

    monkeypatch.setenv("KVFORGE_LINEAR", "fast")
    with pytest.raises(ValueError, match="KVFORGE_LINEAR must be one of auto, onednn, panel"):
        Linear(4, 4).pack()


def test_auto_takes_the_panel_kernel_only_without_avx512(monkeypatch):
    """auto: panel where its AVX2+FMA path is built and the CPU has no AVX-512; oneDNN on AVX-512 CPUs."""
    from kvforge.models import linear

    monkeypatch.delenv("KVFORGE_LINEAR", raising=False)
    monkeypatch.setattr(linear, "panel_kernel_available", lambda: True)
    monkeypatch.setattr(linear, "panel_kernel_simd", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert linear.linear_backend() == "panel"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert linear.linear_backend() == "onednn"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(linear, "panel_kernel_simd", lambda: False)  # plain-C build: oneDNN is faster
    assert linear.linear_backend() == "onednn"
    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    assert linear.linear_backend() == "panel"
