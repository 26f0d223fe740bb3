"""`quantization="w8a8_int8"`: int8 weights per output channel read with int8 activations quantized per token.

The kernel (`kvf_qlinear_a8`) must compute exactly what `quant_linear.reference_a8` says in torch: the
integer dot of each row's int8 activations with the int8 codes, then float(dot) x (s_row x scale_col). The
dot is an integer, so the VNNI build, the AVX2 build and the plain-C build agree bit for bit. The reference
itself is held to the error its two quantizations allow against a float64 matmul, and an engine running
w8a8 gives the greedy tokens of the same model with every quantized layer computed by the reference.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kernel_builds import run_built_with
from test_weight_quant import assert_same_greedy_outputs
from kvforge.models import quant_linear
from kvforge.models.linear import Linear
from kvforge.models.quant_linear import (pack_codes, quant_linear as qlinear, quantize,
                                         quantize_activations, reference_a8)

pytestmark = pytest.mark.skipif(quant_linear.LIBRARY.load() is None, reason=f"{quant_linear.LIBRARY.error}")

ROWS = (1, 2, 3, 4, 5, 8, 9, 13, 32, 130)
# every K mod 4, N not a panel multiple; 13 and 22 panels fill one-row tiles of 6 (and a thread's next tile)
SHAPES = [(37, 130), (16, 64), (53, 257), (1, 33), (20, 6), (48, 1027), (200, 72), (339, 41)]


def exact_against(reference, qw: quant_linear.QuantWeight, rows: int, dtype: torch.dtype, seed: int,  # type: ignore[no-untyped-def]
                  bias: bool = False) -> None:
    """The kernel's output for random rows of scale-varying x equals `reference`'s bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, qw.k, generator=g) * torch.rand(rows, 1, generator=g) * 3).to(dtype)
    b = torch.randn(qw.n, generator=g) if bias else None
    y = qlinear(x, qw, b)
    ref = reference(x, qw, b)
    assert y.dtype == dtype and y.shape == (rows, qw.n)
    assert torch.equal(y, ref), f"rows={rows}: max diff {(y.float() - ref.float()).abs().max().item():.3g}"


def _exact(qw: quant_linear.QuantWeight, rows: int, dtype: torch.dtype, seed: int, bias: bool = False) -> None:
    exact_against(reference_a8, qw, rows, dtype, seed, bias)


@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_is_the_reference_bit_for_bit(n, k):
    qw = quantize(torch.randn(n, k) * 0.2, "w8a8_int8")
    assert qw.act_int8 and qw.bits == 8 and qw.describe.startswith("int8 per channel x int8 activations")
    for rows in ROWS:
        _exact(qw, rows, torch.float32, seed=rows, bias=rows % 2 == 1)
        _exact(qw, rows, torch.bfloat16, seed=rows + 100, bias=rows % 2 == 0)


def test_a_row_gives_the_same_bits_alone_or_in_any_batch():
    """Batch invariance: per-row scales, exact integer sums and a fixed FMA order per row, whatever the tile
    (up to 4 rows x 4 panels, or 8 x 3) and the thread split."""
    qw = quantize(torch.randn(70, 300) * 0.1, "w8a8_int8")
    x = torch.randn(37, 300).to(torch.bfloat16)
    whole = qlinear(x, qw)
    for rows in ((5,), (0, 1), (3, 4, 5, 6, 7), tuple(range(9, 30))):
        assert torch.equal(qlinear(x[list(rows)], qw), whole[list(rows)])
    assert torch.equal(qlinear(x, qw, num_threads=1), whole)


def test_full_code_range_and_zero_rows():
    """GGUF's Q8_0 codes reach -128 (the kernel flips each code to code + 128 for `vpdpbusd`): the full
    range must survive, and an all-zero row (scale 0) gives the bias alone."""
    g = torch.Generator().manual_seed(3)
    n, k = 35, 203
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0, :] = -128
    codes[1, :] = 127
    qw = pack_codes(codes, torch.rand(n, 1, generator=g) * 0.01 + 1e-3, None, 8, k, act_int8=True)
    x = torch.randn(6, k, generator=g)
    x[2] = 0.0
    x[4] = x[4].abs()  # one-signed rows: q up to +127 everywhere
    b = torch.randn(n, generator=g)
    y = qlinear(x, qw, b)
    assert torch.equal(y, reference_a8(x, qw, b))
    assert torch.equal(y[2], b)


def test_reference_error_is_what_the_two_quantizations_allow():
    """Not a tautology: against x @ W^T in float64, each output may be off by the activations' half steps
    (one per group of 32 k) against |W|, the weights' half step against |x|, and their product."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 300, generator=g) * 0.1
    x = torch.randn(11, 300, generator=g)
    x[:, 5] *= 40  # an outlier channel: only its own group's step grows
    qw = quantize(w, "w8a8_int8")
    y = reference_a8(x, qw).double()
    exact = x.double() @ w.double().t()
    q, s = quantize_activations(x)
    assert s.shape == (11, 10)
    step = s.double().repeat_interleave(32, dim=1)[:, :300] / 2  # per element
    assert bool(((q.double() * step * 2 - x.double()).abs() <= step * 1.0001).all())
    dw = w.abs().amax(dim=1).double() / 254  # per output channel
    bound = step @ w.double().abs().t() + dw[None, :] * x.double().abs().sum(1)[:, None] \
        + (step @ torch.ones(300, 40, dtype=torch.float64)) * dw[None, :] + 1e-5 * exact.abs() + 1e-6
    assert bool(((y - exact).abs() <= bound).all())
    assert (y - exact).abs().max() > 0  # and it is a quantized result, not the exact one


def test_pack_refuses_grouped_int8_or_odd_int4_groups():
    with pytest.raises(ValueError, match="int8 activations take int8 codes per output channel"):
        pack_codes(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 4), torch.zeros(4, 4), 4, 16, act_int8=True)
    with pytest.raises(ValueError, match="per output channel"):
        pack_codes(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), None, 8, 32, act_int8=True)


@pytest.mark.parametrize("flags", ["-mno-avx512f", pytest.param("-mno-avx512f -mno-avx2 -mno-fma",
                                                                 marks=pytest.mark.slow)])
def test_builds_without_vnni_give_the_same_bits(kernel_cache, flags):
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_w8a8 import SHAPES, _exact\n"
        "from kvforge.models.quant_linear import a8_path, quantize\n"
        "assert a8_path() == 'c', a8_path()\n"
        "for n, k in SHAPES[:4]:\n"
        "    qw = quantize(torch.randn(n, k) * 0.2, 'w8a8_int8')\n"
        "    for rows in (1, 4, 9, 33):\n"
        "        _exact(qw, rows, torch.float32, seed=rows, bias=True)\n"
        "        _exact(qw, rows, torch.bfloat16, seed=rows)\n"
        "print('ok')\n"
    )
    run_built_with(flags, kernel_cache, code)


def engine_matches_reference(tmp_path, monkeypatch, quantization: str, reference_fn, weight_only_fn, describe_text: str,
                             **engine_kwargs) -> None:
    """An engine with `quantization` (int8 activations) gives the greedy tokens and logprobs of the same codes
    with every such layer computed by `reference_fn` in torch (prefill, decode and the fused decode layers
    against Python layers); the lm_head stays weight-only int8 (`layer_method`). And the activations'
    quantization is real: with each such layer computed by `weight_only_fn` the logprobs move."""
    from tiny_models import build_tiny_model

    from kvforge import LLM, SamplingParams
    from kvforge.models import linear as linear_module
    from kvforge.models.weight_quant import describe

    build_tiny_model(str(tmp_path), "llama_d64", num_hidden_layers=2, intermediate_size=200)
    llm = LLM(model=str(tmp_path), dtype="float32", quantization=quantization, enable_prefix_caching=False,
              log_ledger=False, num_kv_blocks=64, **engine_kwargs)
    model = llm.engine.model
    layers = {name: m.quant_weight for name, m in model.named_modules()
              if isinstance(m, Linear) and m.quant_weight is not None}
    assert len(layers) == 4 * 2 + 1
    assert layers["lm_head"].bits == 8 and not layers["lm_head"].act_int8
    assert all(qw.act_int8 for name, qw in layers.items() if name != "lm_head")
    assert describe_text in describe(model)
    prompts = ["hello there, quantized world", "abc" * 20]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    got = llm.generate(prompts, params)

    kernel = linear_module.quant_linear

    def through(fn):  # type: ignore[no-untyped-def]
        return lambda x, qw, bias=None: fn(x, qw, bias) if qw.act_int8 else kernel(x, qw, bias)

    monkeypatch.setattr(linear_module, "quant_linear", through(reference_fn))
    monkeypatch.setenv("KVFORGE_FUSED_LAYERS", "0")  # every decode step through Linear.forward
    assert_same_greedy_outputs(got, llm.generate(prompts, params))
    monkeypatch.setattr(linear_module, "quant_linear", through(weight_only_fn))
    weight_only = llm.generate(prompts, params)
    assert any(abs(lp - lb.get(tok, 0.0)) > 1e-4 for a, b in zip(got, weight_only)
               for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for tok, lp in la.items())


def test_engine_greedy_tokens_equal_the_torch_reference(tmp_path, monkeypatch):
    """Every w8a8 layer computes `reference_a8`; the same codes read with the model's activations (weight-only
    int8) decode otherwise."""
    engine_matches_reference(tmp_path, monkeypatch, "w8a8_int8", reference_a8,
                             lambda x, qw, bias: qlinear(x, replace(qw, act_int8=False), bias),
                             "int8 per channel x int8 activations g32 x8")


def test_option_is_accepted_and_checked():
    from kvforge.engine.args import EngineArgs

    EngineArgs(quantization="w8a8_int8")  # accepted
    with pytest.raises(ValueError, match="device must be cpu"):
        EngineArgs(quantization="w8a8_int8", device="cuda")
