"""`quantization="w4a8"`: int4 weights in groups along K read with int8 activations (groups of 32 k per row).

The kernel (`kvf_qlinear_a8w4`) must compute exactly what `quant_linear.reference_a8w4` says in torch: per
activation group, the exact integer dot of the row's int8 activations with the nibbles, then two fp32 FMAs
(the weight group's scale and offset). The dots are integers, so the VNNI build and the plain-C builds agree
bit for bit. The reference is held to the error its two quantizations allow against a float64 matmul, and
an engine running w4a8 gives the greedy tokens of the same model with every quantized layer computed by the
reference.
"""
from __future__ import annotations

import os

import pytest
import torch

from kernel_builds import run_built_with
from test_w8a8 import engine_matches_reference, exact_against
from kvforge.models import quant_linear
from kvforge.models.quant_linear import (_unpanel, dequantize, pack_codes, quant_linear as qlinear, quantize,
                                         quantize_activations, quantize_rows, reference_a8w4)

pytestmark = pytest.mark.skipif(quant_linear.LIBRARY.load() is None, reason=f"{quant_linear.LIBRARY.error}")

ROWS = (1, 2, 3, 4, 5, 8, 9, 13, 32, 130)
# every K mod 8, short last groups (of the weights and of the activations), N not a panel multiple
# 22 and 17 panels: whole one-row tiles of 8 with a thread's next tile prefetched
SHAPES = [(37, 130, 32), (16, 64, 64), (53, 257, 128), (1, 33, 32), (20, 6, 32), (48, 1027, 64), (19, 300, 128),
          (339, 96, 32), (272, 136, 64)]


def _exact(qw: quant_linear.QuantWeight, rows: int, dtype: torch.dtype, seed: int, bias: bool = False) -> None:
    exact_against(reference_a8w4, qw, rows, dtype, seed, bias)


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_kernel_is_the_reference_bit_for_bit(n, k, group):
    qw = quantize(torch.randn(n, k) * 0.2, "w4a8", group)
    assert qw.act_int8 and qw.bits == 4 and qw.describe == f"int4 g{group} x int8 activations g32"
    for rows in ROWS:
        _exact(qw, rows, torch.float32, seed=rows, bias=rows % 2 == 1)
        _exact(qw, rows, torch.bfloat16, seed=rows + 100, bias=rows % 2 == 0)


def test_layout_holds_the_codes_and_fp16_scales():
    """The w4a8 layout ([panels, K8, 16, 4]) gives the codes back, whole or by rows; its scales and offsets
    are fp16 (4 bytes a group), the codes made against those rounded values (how close that is to w:
    test_weight_quant's `test_int4_search_never_loses_to_min_max`)."""
    w = torch.randn(45, 203) * 0.1
    codes, scales, offsets, bits, group = quantize_rows(w, "w4a8", 64)
    assert bits == 4 and group == 64
    assert torch.equal(scales, scales.half().float()) and torch.equal(offsets, offsets.half().float())
    qw = quantize(w, "w4a8", 64)
    assert qw.codes.shape == (3, 26, 16, 4) and qw.scales.dtype == qw.offsets.dtype == torch.float16
    assert qw.nbytes == 3 * 26 * 64 + 2 * 4 * 48 * 2
    assert torch.equal(_unpanel(qw), codes)
    rows = torch.tensor([0, 44, 17, 16])
    assert torch.equal(_unpanel(qw, rows), codes[rows])
    g = torch.arange(203) // 64
    manual = (codes.double() * scales.double()[:, g] + offsets.double()[:, g]).float()
    assert torch.equal(dequantize(qw), manual)
    assert torch.equal(dequantize(qw, rows), manual[rows])


def test_refuses_weights_beyond_fp16():
    with pytest.raises(ValueError, match="fp16"):
        quantize(torch.full((2, 64), 1e6), "w4a8", 32)


def test_a_row_gives_the_same_bits_alone_or_in_any_batch():
    """Per-row activation scales, exact integer sums and a fixed FMA order per row, whatever the tile (2 rows x
    4 panels or 4 x 2) and the thread split."""
    qw = quantize(torch.randn(70, 320) * 0.1, "w4a8", 64)
    x = torch.randn(37, 320).to(torch.bfloat16)
    whole = qlinear(x, qw)
    for rows in ((5,), (0, 1), (3, 4, 5), (3, 4, 5, 6, 7), tuple(range(9, 30))):
        assert torch.equal(qlinear(x[list(rows)], qw), whole[list(rows)])
    assert torch.equal(qlinear(x, qw, num_threads=1), whole)


def test_full_code_range_and_zero_rows():
    """Codes 0 and 15 everywhere, one-signed rows (q up to +127) and an all-zero row (the bias alone)."""
    g = torch.Generator().manual_seed(3)
    n, k = 35, 224
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :] = 0
    codes[1, :] = 15
    scales = torch.rand(n, 7, generator=g) * 0.01 + 1e-3
    offsets = -8 * scales
    qw = pack_codes(codes, scales, offsets, 4, 32, act_int8=True)
    x = torch.randn(6, k, generator=g)
    x[2] = 0.0
    x[4] = x[4].abs()
    b = torch.randn(n, generator=g)
    y = qlinear(x, qw, b)
    assert torch.equal(y, reference_a8w4(x, qw, b))
    assert torch.equal(y[2], b)


def test_reference_error_is_what_the_two_quantizations_allow():
    """Not a tautology: against x @ Wq^T in float64 (Wq the dequantized int4 weight, so only the activations'
    rounding is left), each output may be off by the activations' half steps against |Wq|."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 320, generator=g) * 0.1
    x = torch.randn(11, 320, generator=g)
    x[:, 5] *= 40  # an outlier channel: only its own group's step grows
    qw = quantize(w, "w4a8", 128)
    wq = dequantize(qw).double()
    y = reference_a8w4(x, qw).double()
    exact = x.double() @ wq.t()
    _, s = quantize_activations(x)
    step = s.double().repeat_interleave(32, dim=1)[:, :320] / 2
    bound = step @ wq.abs().t() + 1e-5 * (x.double().abs() @ wq.abs().t()) + 1e-6
    assert bool(((y - exact).abs() <= bound).all())
    assert (y - exact).abs().max() > 0


def test_refuses_groups_that_split_activation_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 64), "w4a8", 16)
    with pytest.raises(ValueError, match="int4 codes in groups of a multiple of 32"):
        pack_codes(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 4), torch.zeros(4, 4), 4, 16, act_int8=True)


@pytest.mark.parametrize("flags", ["-mno-avx512f", pytest.param("-mno-avx512f -mno-avx2 -mno-fma",
                                                                 marks=pytest.mark.slow)])
def test_builds_without_vnni_give_the_same_bits(kernel_cache, flags):
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_w4a8 import SHAPES, _exact\n"
        "from kvforge.models.quant_linear import a8_path, quantize\n"
        "assert a8_path() == 'c', a8_path()\n"
        "for n, k, group in SHAPES[:4]:\n"
        "    qw = quantize(torch.randn(n, k) * 0.2, 'w4a8', group)\n"
        "    for rows in (1, 3, 9, 33):\n"
        "        _exact(qw, rows, torch.float32, seed=rows, bias=True)\n"
        "        _exact(qw, rows, torch.bfloat16, seed=rows)\n"
        "print('ok')\n"
    )
    run_built_with(flags, kernel_cache, code)


def test_engine_greedy_tokens_equal_the_torch_reference(tmp_path, monkeypatch):
    """Every w4a8 layer computes `reference_a8w4`; the same int4 weights with the model's activations (x @
    dequantize(W)^T) decode otherwise."""
    def weight_only(x, qw, bias):  # type: ignore[no-untyped-def]
        y = x.float() @ dequantize(qw).t()
        return (y if bias is None else y + bias.float()).to(x.dtype)

    engine_matches_reference(tmp_path, monkeypatch, "w4a8", reference_a8w4, weight_only,
                             "int4 g64 x int8 activations g32 x8", quantization_group_size=64)


def test_option_is_accepted_and_checked():
    from kvforge.engine.args import EngineArgs

    EngineArgs(quantization="w4a8", quantization_group_size=128)  # accepted
    with pytest.raises(ValueError, match="device must be cpu"):
        EngineArgs(quantization="w4a8", device="cuda")
