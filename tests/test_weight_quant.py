"""Weight-only int8 / int4 linear layers (`quantization=`): the kernel against dequantize-then-matmul for every
format and group size, odd K and N, 1-1,030 rows, fp32 and bf16 activations, in the AVX-512, AVX2 and
plain-C builds; and an engine whose int8 / int4 weights give the same greedy tokens as the same weights
dequantized and run through torch in fp32."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from kernel_builds import run_built_with
from kvforge.models import gguf_quant, quant_linear
from kvforge.models.linear import Linear
from kvforge.models.quant_linear import dequantize, pack_codes, quant_linear as qlinear, quantize
from kvforge.models.weight_quant import QuantEmbedding

pytestmark = pytest.mark.skipif(quant_linear.LIBRARY.load() is None, reason=f"{quant_linear.LIBRARY.error}")

# (name, bits, group): what `quantization=` makes, and the GGUF block formats (groups of 16 / 32, offsets)
FORMATS = [("int8", 8, None), ("int4", 4, 32), ("int4", 4, 64), ("int4", 4, 128)]
ROWS = (1, 2, 3, 4, 5, 8, 13, 64, 1030)


def _gguf_like(n: int, k: int, bits: int, group: int, seed: int, offsets: bool = False) -> quant_linear.QuantWeight:
    """Codes with per-group scales (and, for int4 and `offsets`, free offsets, as Q4_K's / Q5_K's mins give):
    the layouts GGUF blocks convert to."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=g) * 0.1 + 0.01
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        return pack_codes(codes, scales, torch.randn(n, groups, generator=g) * 0.05 if offsets else None, 8, group)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    return pack_codes(codes, scales, torch.randn(n, groups, generator=g) * 0.05, 4, group)


def check(qw: quant_linear.QuantWeight, rows: int, dtype: torch.dtype, seed: int = 0, bias: bool = False) -> None:
    """The kernel's y against x @ dequantize(W)^T in float64: within fp32 summation error (and, for bf16
    output, one bf16 rounding)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, qw.k, generator=g).to(dtype)
    b = torch.randn(qw.n, generator=g).to(dtype) if bias else None
    y = qlinear(x, qw, b)
    assert y.dtype == dtype and y.shape == (rows, qw.n)
    w = dequantize(qw).double()
    ref = x.double() @ w.t() + (b.double() if b is not None else 0.0)
    bound = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6
    if dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0 ** -8
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} over bound at rows={rows}"


@pytest.mark.parametrize("name,bits,group", FORMATS, ids=[f"{n}-g{g}" for n, _, g in FORMATS])
@pytest.mark.parametrize("n,k", [(37, 130), (16, 64), (53, 255), (1, 33), (300, 70)])  # 19 panels: tiles with a next one
def test_quantized_kernel_matches_dequantize_then_matmul(name, bits, group, n, k):
    w = torch.randn(n, k) * 0.2
    qw = quantize(w, name, group)
    assert qw.bits == bits and qw.n == n and qw.k == k
    for rows in ROWS:
        check(qw, rows, torch.float32, seed=rows)
    for rows in (1, 3, 4, 5, 6, 8, 9, 130):  # decode rows (int8 x bf16: nibble or whole bf16 pairs), GEMM rows
        check(qw, rows, torch.bfloat16, seed=rows, bias=True)


@pytest.mark.parametrize("bits,group,offsets", [(8, 16, False), (8, 32, False), (8, 32, True), (8, 16, True),
                                                (4, 32, True), (4, 16, True)])
def test_grouped_codes_with_offsets_match(bits, group, offsets):
    """The layouts GGUF's blocks become (Q6_K: int8 codes in groups of 16; Q8_0 / Q5_0: 32; Q5_1 / Q5_K: int8
    in groups of 32 with offsets; Q4_0 / Q4_K: int4 in groups of 32 with offsets): same kernel, same reference."""
    qw = _gguf_like(45, 96 + 5, bits, group, seed=bits + group, offsets=offsets)
    for rows in (1, 3, 4, 6, 1030):
        check(qw, rows, torch.float32, seed=rows, bias=True)
    for rows in (1, 3, 4, 5, 8, 9, 17, 130):  # decode rows, and bf16 GEMM rows: the codes as bf16, scales per group
        check(qw, rows, torch.bfloat16, seed=rows, bias=True)  # (odd K: a pad pair; the last group 5 k)


def test_int8_error_is_half_a_step():
    """int8: at most half a step (max|w| / 254) per weight."""
    w = torch.randn(64, 250)
    err8 = (dequantize(quantize(w, "int8")) - w).abs()
    assert bool((err8 <= w.abs().amax(dim=1, keepdim=True) / 254 * 1.0001).all())


def group_errors(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 group: int) -> torch.Tensor:
    """Each group's squared error [N, groups] of `code x scale + offset` against w, in float64."""
    n, k = w.shape
    g = torch.arange(k) // group
    d = codes.double() * scales.double()[:, g] + offsets.double()[:, g] - w.double()
    return torch.zeros(n, scales.shape[1], dtype=torch.float64).index_add_(1, g, d * d)


def minmax_rule(w: torch.Tensor, group: int, fp16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain rule the search starts from: each group's [min, max] in 15 steps (codes, scales, offsets)."""
    n, k = w.shape
    g = torch.arange(k) // group
    groups = int(g[-1]) + 1
    lo = torch.full((n, groups), float("inf")).scatter_reduce(1, g.expand(n, k), w, "amin")
    hi = torch.full((n, groups), float("-inf")).scatter_reduce(1, g.expand(n, k), w, "amax")
    s, o = (hi - lo) / 15, lo
    if fp16:
        s, o = s.half().float(), o.half().float()
    codes = torch.round((w - o[:, g]) / torch.where(s > 0, s, 1.0)[:, g]).clamp(0, 15)
    return codes, s, o


@pytest.mark.parametrize("method", ["int4", "w4a8"])
@pytest.mark.parametrize("n,k,group", [(64, 250, 32), (40, 2048, 32), (24, 4096, 128), (9, 64 * 17 + 40, 64)])
def test_int4_search_never_loses_to_min_max(method, n, k, group):
    """Every group's squared error is at most the [min, max]-in-15-steps rule's (the search tries that step
    and refits it), and over a layer of Gaussian weights it is clearly lower. Shapes: groups taken 16 at a
    time (one a vector lane) and the leftovers, a short last group. w4a8's scales and offsets are fp16 and
    the codes are made against those rounded values."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    codes, scales, offsets, bits, got_group = quant_linear.quantize_rows(w, method, group)
    assert bits == 4 and got_group == group and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    if method == "w4a8":
        assert torch.equal(scales, scales.half().float()) and torch.equal(offsets, offsets.half().float())
    ours = group_errors(w, codes, scales, offsets, group)
    plain = group_errors(w, *minmax_rule(w, group, fp16=method == "w4a8"), group)
    assert bool((ours <= plain * (1 + 1e-5) + 1e-12).all())
    assert float(ours.sum() / plain.sum()) < 0.95


@pytest.mark.parametrize("group", [32, 128])
def test_int4_search_finds_a_coarser_grid(group):
    """Weights already on a grid of at most 15 steps (a GGUF 4- or 5-bit block re-quantized: codes that use
    only part of their range) come back exactly, where the min/max rule stretches its 15 steps over them."""
    gen = torch.Generator().manual_seed(group)
    n, k = 32, 16 * group + group  # 16 groups in lanes, one more alone
    span = torch.randint(9, 16, (n, k // group, 1), generator=gen)
    q = (torch.rand(n, k // group, group, generator=gen) * (span + 1)).floor().clamp(max=span)
    q[:, :, 0], q[:, :, 1] = 0, span[:, :, 0]  # the grid's ends are used
    d = torch.rand(n, k // group, 1, generator=gen) * 0.02 + 0.001
    w = (q * d - torch.rand(n, k // group, 1, generator=gen) * 0.1).view(n, k)
    back = dequantize(quantize(w, "int4", group))
    assert torch.allclose(back, w, rtol=0, atol=1e-6)
    codes, s, o = minmax_rule(w, group)
    g = torch.arange(k) // group
    assert (codes * s[:, g] + o[:, g] - w).abs().max() > 1e-3


def test_int4_groups_in_lanes_equal_groups_alone():
    """Groups quantized 16 at a time (a vector lane each) get the codes, scales and offsets they get one
    at a time (a row of one group takes the one-group path)."""
    w = torch.randn(50, 16 * 64) * 0.05
    lanes = quant_linear.quantize_rows(w, "int4", 64)
    alone = quant_linear.quantize_rows(w.reshape(-1, 64), "int4", 64)
    assert torch.equal(lanes[0], alone[0].reshape(50, -1))
    assert torch.equal(lanes[1], alone[1].reshape(50, 16)) and torch.equal(lanes[2], alone[2].reshape(50, 16))


def test_embedding_rows_are_the_lm_head_codes():
    """A tied model's embedding lookup reads the rows of the lm_head's codes: dequantize(W)[ids]."""
    qw = quantize(torch.randn(50, 24), "int4", 32)
    ids = torch.tensor([[0, 17, 49], [3, 3, 16]])
    emb = QuantEmbedding(qw, torch.float32)(ids)
    assert torch.equal(emb, dequantize(qw)[ids])


def _run_built_with(flags: str, tmp_path, expect: str) -> None:
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_weight_quant import FORMATS, check, _gguf_like\n"
        "from kvforge.models.quant_linear import quantize, simd_level\n"
        f"assert simd_level() == {expect!r}, simd_level()\n"
        "for name, bits, group in FORMATS:\n"
        "    qw = quantize(torch.randn(37, 131) * 0.2, name, group)\n"
        "    for rows in (1, 2, 4, 5, 9, 1030):\n"
        "        check(qw, rows, torch.float32, seed=rows)\n"
        "    for rows in (1, 3, 5, 9):\n"
        "        check(qw, rows, torch.bfloat16, seed=rows, bias=True)\n"
        "check(_gguf_like(21, 70, 4, 32, 1), 7, torch.float32, bias=True)\n"
        "check(_gguf_like(21, 70, 8, 32, 2, offsets=True), 7, torch.float32, bias=True)\n"
        "check(_gguf_like(21, 70, 8, 32, 2, offsets=True), 40, torch.float32)\n"
        "print('ok')\n"
    )
    run_built_with(flags, tmp_path, code)


@pytest.mark.parametrize("flags,expect", [
    ("-mno-avx512f", "avx2"), pytest.param("-mno-avx512f -mno-avx2 -mno-fma", "c", marks=pytest.mark.slow),
    ("-mno-avx512vbmi", "avx512")])  # AVX-512 without VBMI: int8 x bf16 decode rows on fp32 FMAs again
def test_avx2_plain_c_and_no_vbmi_builds_match(tmp_path, flags, expect):
    if expect == "avx2" and quant_linear.simd_level() == "c":
        pytest.skip("this CPU has no AVX2")
    if expect == "avx512" and quant_linear.simd_level() != "avx512":
        pytest.skip("this CPU has no AVX-512")
    _run_built_with(flags, tmp_path, expect)


def _dequantized_in_fp32(model: nn.Module) -> None:
    """Replace every quantized layer (and a tied embedding) by its dequantized fp32 weight, run by torch."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantEmbedding):
                setattr(parent, name, nn.Embedding.from_pretrained(dequantize(child.quant_weight), freeze=True))
    for m in model.modules():
        if isinstance(m, Linear) and m.quant_weight is not None:
            m.weight = nn.Parameter(dequantize(m.quant_weight), requires_grad=False)
            m.quant_weight = None


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_engine_greedy_tokens_equal_the_dequantized_fp32_model(tmp_path, method):
    """The kernel adds no error of its own: the int8 / int4 engine's greedy tokens equal those of the same
    codes dequantized to fp32 weights (torch's matmuls), and the last step's logits agree to fp32 rounding."""
    from tiny_models import build_tiny_model

    from kvforge import LLM, SamplingParams

    build_tiny_model(str(tmp_path), "llama_d64", num_hidden_layers=2, intermediate_size=200)
    llm = LLM(model=str(tmp_path), dtype="float32", quantization=method, enable_prefix_caching=False,
              log_ledger=False, num_kv_blocks=64)
    model = llm.engine.model
    quantized = [m.quant_weight for m in model.modules() if isinstance(m, Linear) and m.quant_weight is not None]
    assert len(quantized) == 4 * 2 + 1 and model.lm_head.quant_weight.bits == 8  # int4 keeps the lm_head int8
    assert any(isinstance(m, QuantEmbedding) for m in model.modules())  # tied: the embedding reads the codes
    prompts = ["hello there, quantized world", "abc" * 20]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    quantized = llm.generate(prompts, params)
    _dequantized_in_fp32(model)
    reference = llm.generate(prompts, params)
    assert_same_greedy_outputs(quantized, reference)


def assert_same_greedy_outputs(got, reference, tol: float = 1e-4) -> None:
    """Two runs' outputs: the same greedy tokens, and each step's top logprobs the same tokens within `tol`."""
    for a, b in zip(got, reference, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok, lp in la.items():
                assert abs(lp - lb[tok]) < tol


def test_quantization_option_errors():
    from kvforge.engine.args import EngineArgs

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size"):
        EngineArgs(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="device must be cpu"):
        EngineArgs(quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="is not a .gguf"):
        EngineArgs(quantization="gguf", model="/some/hf-folder")


GGUF_TYPES = [gguf_quant.Q8_0, gguf_quant.Q6_K, gguf_quant.Q5_0, gguf_quant.Q5_1, gguf_quant.Q5_K, gguf_quant.IQ4_NL,
              gguf_quant.IQ4_XS, gguf_quant.Q4_0, gguf_quant.Q4_1, gguf_quant.Q4_K, gguf_quant.Q3_K, gguf_quant.Q2_K]
GGUF_TYPE_NAMES = ["Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS", "Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K"]
WITH_MINS = (gguf_quant.Q4_1, gguf_quant.Q4_K, gguf_quant.Q5_1, gguf_quant.Q5_K, gguf_quant.Q2_K)


def _random_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """Random block bytes with finite fp16 scales where each format keeps them."""
    elems, nbytes = gguf_quant.BLOCK[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    half = lambda: rng.uniform(0.001, 0.05, size=(len(b), 1)).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype in (gguf_quant.Q8_0, gguf_quant.Q5_0, gguf_quant.Q4_0, gguf_quant.IQ4_NL, gguf_quant.IQ4_XS):
        b[:, :2] = half()
    elif qtype == gguf_quant.Q2_K:  # d and dmin last
        b[:, 80:82], b[:, 82:84] = half(), half()
    elif qtype in WITH_MINS:  # d and the min (or dmin) first
        b[:, 0:2], b[:, 2:4] = half(), half()
    else:  # Q6_K, Q3_K: fp16 d last
        b[:, nbytes - 2:] = half()
    return b


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=GGUF_TYPE_NAMES)
def test_gguf_blocks_decode_to_the_gguf_dequantizer(qtype):
    """Each block format converted to kernel codes (no float copy) dequantizes to what the `gguf` package
    gives (Q8_0, Q6_K, Q5_0, IQ4_NL, IQ4_XS, Q4_0 bit for bit; those with mins within one fp32 rounding: the kernel's FMA rounds
    q x scale + min once, the package twice), and the kernel multiplies those weights."""
    from gguf.quants import dequantize as gguf_dequantize

    n, k = 24, 512
    raw = _random_blocks(qtype, n, k, seed=qtype)
    want = torch.from_numpy(np.asarray(gguf_dequantize(raw.reshape(-1), qtype), dtype=np.float32).reshape(n, k))
    codes, scales, offsets, bits, group = gguf_quant.gguf_codes(raw, qtype, n, k)
    qw = pack_codes(codes, scales, offsets, bits, group)
    got = dequantize(qw)
    if qtype in WITH_MINS:
        torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-7)
    else:
        assert torch.equal(got, want)
    check(qw, 3, torch.float32)
    check(qw, 40, torch.float32)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=GGUF_TYPE_NAMES)
def test_gguf_float_load_is_the_gguf_dequantizer_bit_for_bit(qtype):
    """Loading a GGUF in float32 / bfloat16 dequantizes through `gguf_quant.dequantize` (vectorized), which
    must give the `gguf` package's floats exactly: the parity tests against transformers rest on them."""
    from gguf.quants import dequantize as gguf_dequantize

    n, k = 24, 512
    raw = _random_blocks(qtype, n, k, seed=100 + qtype)
    want = torch.from_numpy(np.asarray(gguf_dequantize(raw.reshape(-1), qtype), dtype=np.float32).reshape(n, k))
    got = gguf_quant.dequantize(raw, qtype, n, k)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_eval_weights_reports_each_format_against_the_reference(tmp_path, capsys):
    """`kvforge eval weights`: one row per format, the reference at +0.00%, int8 close to it and smaller."""
    import json

    from tiny_models import build_tiny_model

    from kvforge.cli import main

    build_tiny_model(str(tmp_path), "llama_d64")
    assert main(["eval", "weights", "--model", str(tmp_path), "--dtype", "float32", "--formats", "none,int8",
                 "--contexts", "48,96", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["format"] for r in rows] == ["none", "int8"]
    assert rows[1]["weights_bytes"] < rows[0]["weights_bytes"] and rows[0]["kl"] == 0.0
    for c in ("48", "96"):
        assert abs(rows[1]["perplexity"][c] / rows[0]["perplexity"][c] - 1) < 0.05
    assert 0 < rows[1]["kl"] < 0.05
    assert main(["eval", "weights", "--model", str(tmp_path), "--formats", "none,int3"]) == 2
    assert main(["eval", "weights", "--model", str(tmp_path), "--formats", "none,gguf"]) == 2  # not a .gguf


@pytest.mark.slow
def test_default_model_keeps_its_gguf_codes_and_tokens():
    """quantization="gguf" on the default model (Q4_1 layers, a Q8_0 tied embedding): every linear layer runs
    on the file's own codes, and greedy tokens equal the usual load's (the same blocks dequantized to fp32,
    run by the panel kernels); logprobs within fp32 summation order (and Q4_1's one rounding)."""
    from kvforge import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    kept = LLM(dtype="float32", quantization="gguf", enable_prefix_caching=False, num_kv_blocks=32, log_ledger=False)
    model = kept.engine.model
    layers = [m.quant_weight for m in model.modules() if isinstance(m, Linear) and m.quant_weight is not None]
    assert len(layers) == 4 * 30 + 1 and {(q.bits, q.group) for q in layers} == {(4, 32), (8, 32)}
    assert any(isinstance(m, QuantEmbedding) for m in model.modules())
    got = kept.generate(prompts, params)
    kept.close()
    ref = LLM(dtype="float32", enable_prefix_caching=False, num_kv_blocks=32, log_ledger=False).generate(prompts, params)
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(la[t] - lb[t]) < 2e-4 for t in la if t in lb)


@pytest.mark.parametrize("method,group", [("int8", None), ("int4", 32), ("w8a8_int8", None), ("w4a8", 64)])
def test_streamed_load_lays_out_the_whole_weights_codes(tmp_path, monkeypatch, method, group):
    """The loader writes each block of rows' codes straight into the panel layout (`write_rows`). Blocks of 7
    rows (panels cut anywhere, q|k|v and gate|up parts arriving in the file's order) must give exactly the
    codes, scales and offsets of quantizing each whole (packed) weight at once."""
    from tiny_models import build_tiny_model

    from kvforge import LLM
    from kvforge.models import weight_stream
    from kvforge.models.layers import PACKED_PARAMS
    from kvforge.models.loader import load_checkpoint

    build_tiny_model(str(tmp_path), "llama_d64")
    weights = load_checkpoint(str(tmp_path)).weights
    monkeypatch.setattr(weight_stream, "rows_per_block", lambda shape, itemsize=4: 7)
    streamed = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=8, log_ledger=False, quantization=method,
                   quantization_group_size=group or 32).engine.model
    checked = 0
    for name, m in streamed.named_modules():
        if isinstance(m, Linear) and m.quant_weight is not None:
            prefix, _, leaf = name.rpartition(".")
            parts = [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in PACKED_PARAMS.get(leaf, (leaf,))]
            if parts == ["lm_head.weight"] and "lm_head.weight" not in weights.source.shapes:
                parts = ["model.embed_tokens.weight"]  # tied
            whole = torch.cat([weights[p].float() for p in parts])
            want = quantize(whole, quant_linear.layer_method(method, name), group)
            got = m.quant_weight
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales), name
            assert (got.offsets is None) == (want.offsets is None)
            assert got.offsets is None or torch.equal(got.offsets, want.offsets)
            checked += 1
    assert checked == 2 * 4 + 1
