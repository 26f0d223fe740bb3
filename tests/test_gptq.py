"""GPTQ int4 codes (`models/gptq.py`) and their calibration at load (`engine/weight_calibration.py`)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvforge.models.gptq import gptq_quantize
from kvforge.models.linear import Linear
from kvforge.models.quant_linear import quantize_rows


def _dequantized(codes, scales, offsets, group):
    cols = torch.arange(codes.shape[1]) // group
    return codes.float() * scales[:, cols] + offsets[:, cols]


def _correlated_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Inputs whose columns are mixed (correlated) and of unequal size, as a layer's activations are."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, k, generator=g)
    mix = torch.eye(k) + 0.4 * torch.randn(k, k, generator=g) / k ** 0.5
    return (z @ mix) * torch.logspace(-0.5, 0.7, k)[torch.randperm(k, generator=g)]


@pytest.mark.parametrize("method", ["int4", "w4a8"])
def test_identity_second_moments_give_the_searchs_codes(method):
    """With uncorrelated, equal inputs no column's error can be moved anywhere useful: GPTQ's codes, scales and
    offsets are exactly the per-group search's."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    got = gptq_quantize(w, torch.eye(96), method, 32)
    want = quantize_rows(w, method, 32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[3:] == want[3:] == (4, 32)


@pytest.mark.parametrize("n,k,group", [(37, 96, 32), (16, 200, 64), (9, 130, 32)])
def test_output_error_is_lower_than_rounding_group_by_group(n, k, group):
    """What GPTQ is for: over the calibration inputs, x W^T moves less than with the search's codes (same
    scales and offsets), including odd N and a short last group."""
    x = _correlated_inputs(4 * k, k, seed=k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    codes, scales, offsets, _, _ = gptq_quantize(w, x.T @ x, "int4", group)
    base = quantize_rows(w, "int4", group)
    assert torch.equal(scales, base[1]) and torch.equal(offsets, base[2])  # static groups: only codes change
    assert int(codes.max()) <= 15
    err = lambda c: float(((x @ (w - _dequantized(c, scales, offsets, group)).T) ** 2).sum())  # noqa: E731
    assert err(codes) < 0.8 * err(base[0])
    held_out = _correlated_inputs(4 * k, k, seed=k)  # same distribution, other rows: still better
    assert float(((held_out @ (w - _dequantized(codes, scales, offsets, group)).T) ** 2).sum()) < float(
        ((held_out @ (w - _dequantized(base[0], scales, offsets, group)).T) ** 2).sum())


def test_a_column_calibration_never_activated_keeps_finite_codes():
    x = _correlated_inputs(256, 64, seed=1)
    x[:, 5] = 0.0
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    codes, scales, offsets, _, _ = gptq_quantize(w, x.T @ x, "int4", 32)
    assert torch.isfinite(_dequantized(codes, scales, offsets, 32)).all()
    # the dead column moved no error and took its own nearest code
    assert torch.equal(codes[:, 5], quantize_rows(w, "int4", 32)[0][:, 5])


def test_bad_arguments_are_refused():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="int4 / w4a8"):
        gptq_quantize(w, torch.eye(64), "int8", 32)
    with pytest.raises(ValueError, match=r"hessian must be \[64, 64\]"):
        gptq_quantize(w, torch.eye(32), "int4", 32)


def test_passes_keep_second_moments_under_the_budget():
    from types import SimpleNamespace

    from kvforge.engine.weight_calibration import hessian_passes

    layers = [(f"l{i}", SimpleNamespace(in_features=k), None) for i, k in enumerate([64, 64, 128, 64, 256])]
    passes = hessian_passes(layers, budget=4 * 64 * 64 * 2)
    assert [[name for name, *_ in p] for p in passes] == [["l0", "l1"], ["l2"], ["l3"], ["l4"]]  # l4 alone: over
    assert [e for p in hessian_passes(layers, budget=1 << 30) for e in p] == layers
    # a decoder layer is never split: a pass resumes at its first one
    block = [(f"model.layers.{i}.{leaf}", SimpleNamespace(in_features=64), None)
             for i in range(3) for leaf in ("self_attn.qkv_proj", "mlp.down_proj")]
    assert [[n for n, *_ in p] for p in hessian_passes(block, budget=4 * 64 * 64 * 3)] == [
        [n for n, *_ in block[i:i + 2]] for i in (0, 2, 4)]


def test_calibration_windows_open_like_a_prompt_and_refuse_short_text():
    from kvforge.engine.weight_calibration import calibration_windows, default_calibration_text
    from kvforge.evaluation.kv_quant import corpus_token_ids
    from kvforge.tokenizer import bos_prefix
    from kvforge.models.loader import load_checkpoint

    tok = load_checkpoint(None).tokenizer
    text = default_calibration_text()
    windows = calibration_windows(tok, 1000, 256, text)
    bos = bos_prefix(tok)
    assert sum(len(w) - len(bos) for w in windows) == 1000 and all(len(w) <= 256 for w in windows)
    assert all(w[:len(bos)] == bos for w in windows)
    # not the text `kvforge eval weights` scores
    assert set(map(tuple, _ngrams(windows[0][len(bos):], 12))).isdisjoint(_ngrams(corpus_token_ids(tok, 20000), 12))
    with pytest.raises(ValueError, match="quantization_calibration_tokens=5000, but the calibration text has"):
        calibration_windows(tok, 5000, 256, "only a few words")


def _ngrams(ids, n):
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


@pytest.mark.slow
def test_engine_fits_int4_codes_to_calibration_text(tmp_path, monkeypatch):
    """quantization_calibration_tokens: every int4 layer's codes are GPTQ's (in the ledger too), the lm_head stays
    int8, several passes when the budget is small, and next-token KL against the dense model on held-out text is
    lower than with codes rounded group by group."""
    from tiny_models import build_tiny_model

    from kvforge.engine import weight_calibration
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine
    from kvforge.evaluation.kv_quant import corpus_windows, kl_sum

    build_tiny_model(str(tmp_path), "llama_d64", num_hidden_layers=2, intermediate_size=200)
    monkeypatch.setattr(weight_calibration, "HESSIAN_BUDGET_BYTES", 4 * 200 * 200)
    monkeypatch.setattr(weight_calibration, "cache_root", lambda: tmp_path / "cache")
    text = tmp_path / "calibration.txt"
    text.write_text(weight_calibration.default_calibration_text()[:40000], encoding="utf-8")

    def engine(**kw):
        return LLMEngine(EngineArgs(model=str(tmp_path), dtype="float32", num_kv_blocks=80, log_ledger=False, **kw))

    dense = engine()
    ids = corpus_windows(dense.tokenizer, 512, 1)[0]
    ref = torch.log_softmax(dense.prompt_logits(ids).float(), -1)
    plain = engine(quantization="int4")
    fitted = engine(quantization="int4", quantization_calibration_tokens=2048,
                    quantization_calibration_file=str(text))
    assert fitted.calibration.passes == 2 and fitted.calibration.layers == 4 * 2  # a decoder layer a pass
    layers = {n: m.quant_weight for n, m in fitted.model.named_modules() if isinstance(m, Linear) and m.quant_weight}
    assert all(qw.fitted_by == "GPTQ" and qw.bits == 4 for n, qw in layers.items() if n != "lm_head")
    assert layers["lm_head"].bits == 8 and layers["lm_head"].fitted_by is None
    assert "int4 g32 GPTQ x8 linear layers" in fitted.report.render()
    kl = lambda e: kl_sum(ref, torch.log_softmax(e.prompt_logits(ids).float(), -1))  # noqa: E731
    assert kl(fitted) < 0.9 * kl(plain)
    assert fitted.pool.num_free_blocks == fitted.pool.num_blocks  # the calibration left no block behind

    # the next load with the same options reads the fitted codes back instead of fitting again
    again = engine(quantization="int4", quantization_calibration_tokens=2048, quantization_calibration_file=str(text))
    assert again.calibration.passes == 0 and again.calibration.cached_from is not None
    for name, m in again.model.named_modules():
        if isinstance(m, Linear) and name != "lm_head":
            assert m.quant_weight.fitted_by == "GPTQ" and torch.equal(m.quant_weight.codes, layers[name].codes)
    assert torch.equal(again.prompt_logits(ids), fitted.prompt_logits(ids))
    # other options fit again; so does a damaged cache file
    assert engine(quantization="int4", quantization_calibration_tokens=1024,
                  quantization_calibration_file=str(text)).calibration.passes > 0
    Path(again.calibration.cached_from).write_bytes(b"not a cache file")
    assert engine(quantization="int4", quantization_calibration_tokens=2048,
                  quantization_calibration_file=str(text)).calibration.passes > 0
    with pytest.raises(ValueError, match="calibration text has"):
        engine(quantization="int4", quantization_calibration_tokens=10**6, quantization_calibration_file=str(text))


@pytest.mark.slow
def test_passes_resumed_at_their_first_decoder_layer_fit_the_same_codes(tmp_path, monkeypatch):
    """A pass resumed from the kept inputs of its first decoder layer sees exactly what a forward from the
    embedding through the already-quantized layers gives: the same codes, bit for bit."""
    from tiny_models import build_tiny_model

    from kvforge.engine import weight_calibration
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine

    build_tiny_model(str(tmp_path), "llama_d64", num_hidden_layers=3, intermediate_size=200)
    monkeypatch.setattr(weight_calibration, "HESSIAN_BUDGET_BYTES", 4 * 200 * 200)
    monkeypatch.setattr(weight_calibration, "cache_root", lambda: tmp_path / "cache")

    def codes():
        e = LLMEngine(EngineArgs(model=str(tmp_path), dtype="float32", num_kv_blocks=80, log_ledger=False,
                                 quantization="w4a8", quantization_calibration_tokens=1024))
        assert e.calibration.passes == 3
        return {n: m.quant_weight.codes for n, m in e.model.named_modules() if isinstance(m, Linear) and m.quant_weight}

    kept = []
    next_inputs = weight_calibration._next_inputs
    monkeypatch.setattr(weight_calibration, "_next_inputs", lambda *a: kept.append(1) or next_inputs(*a))
    resumed = codes()
    assert len(kept) == 2  # passes 2 and 3 resumed at their first decoder layer
    monkeypatch.setattr(weight_calibration, "_decoder_layers", lambda model, fitted: None)  # every pass from the start
    monkeypatch.setattr(weight_calibration, "cache_root", lambda: tmp_path / "another-cache")  # fitted again
    from_start = codes()
    assert len(kept) == 2
    assert resumed.keys() == from_start.keys()
    assert all(torch.equal(resumed[n], from_start[n]) for n in resumed)


@pytest.mark.parametrize("family,tokens,overrides", [
    ("gemma3", 300, {}), ("deepseek_v2", 300, {}), ("qwen3_moe", 300, {}),
    ("qwen3_moe", 2, {"num_experts": 8}),  # 2 tokens x top-2 of 8 experts: some expert gets none
])
def test_calibration_on_other_architectures(tmp_path, monkeypatch, family, tokens, overrides):
    """Sliding-window (Gemma 3), MoE (an expert no calibration token reached keeps the search's codes) and MLA
    (its absorbed projection stays dense) models fit their codes and serve."""
    from tiny_models import build_tiny_model

    from kvforge import LLM, SamplingParams
    from kvforge.engine import weight_calibration

    monkeypatch.setattr(weight_calibration, "cache_root", lambda: tmp_path / "cache")
    build_tiny_model(str(tmp_path / "m"), family, **overrides)
    llm = LLM(model=str(tmp_path / "m"), dtype="float32", quantization="int4", quantization_calibration_tokens=tokens,
              num_kv_blocks=64, log_ledger=False)
    report = llm.engine.calibration
    assert (report.unseen > 0) == (tokens == 2)
    fitted = [m.quant_weight for m in llm.engine.model.modules() if isinstance(m, Linear) and m.quant_weight is not None
              and m.quant_weight.bits == 4]
    assert report.layers > 0 and report.layers + report.unseen == len(fitted)
    assert sum(qw.fitted_by == "GPTQ" for qw in fitted) == report.layers
    out = llm.generate(["hello there"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_eval_weights_scores_fitted_codes(tmp_path, monkeypatch, capsys):
    """`kvforge eval weights --quantization-calibration-tokens`: the int4 row's codes are GPTQ's (its table says
    so); the flag with no int4 / w4a8 row is refused rather than ignored."""
    import json

    from tiny_models import build_tiny_model

    from kvforge.cli import main
    from kvforge.engine import weight_calibration

    monkeypatch.setattr(weight_calibration, "cache_root", lambda: tmp_path / "cache")
    build_tiny_model(str(tmp_path / "m"), "llama_d64")
    args = ["eval", "weights", "--model", str(tmp_path / "m"), "--dtype", "float32", "--contexts", "48", "--json"]
    assert main(args + ["--formats", "none,int4", "--quantization-calibration-tokens", "200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "GPTQ on 200 calibration tokens" in out["model"] and [r["format"] for r in out["rows"]] == ["none", "int4"]
    assert list((tmp_path / "cache" / "gptq").glob("*.pt"))  # the int4 row was fitted
    assert main(args + ["--formats", "none,int8", "--quantization-calibration-tokens", "200"]) == 2
    assert "--formats has neither" in capsys.readouterr().err
    assert main(args + ["--formats", "none,int4", "--quantization-calibration-file", __file__]) == 2


def test_a_cache_file_for_other_shapes_or_damaged_is_not_used(tmp_path):
    from kvforge.engine.weight_calibration import read_fitted_codes, write_fitted_codes
    from kvforge.models.quant_linear import quantize

    qw = quantize(torch.randn(32, 64), "int4", 32)
    path = tmp_path / "codes.pt"
    write_fitted_codes(path, {"a": qw})
    assert torch.equal(read_fitted_codes(path, {"a": (32, 64)})["a"].codes, qw.codes)
    assert read_fitted_codes(path, {"a": (32, 96)}) is None  # another layer shape
    assert read_fitted_codes(path, {"a": (32, 64), "b": (8, 64)}) is None  # other layers
    path.write_bytes(path.read_bytes()[:100])  # cut short
    assert read_fitted_codes(path, {"a": (32, 64)}) is None


def test_calibration_option_errors():
    from kvforge.engine.args import EngineArgs

    with pytest.raises(ValueError, match="quantization_calibration_tokens fits int4 / w4a8"):
        EngineArgs(quantization="int8", quantization_calibration_tokens=256)
    with pytest.raises(ValueError, match="quantization_calibration_tokens must be an integer >= 0"):
        EngineArgs(quantization="int4", quantization_calibration_tokens=-1)
    with pytest.raises(ValueError, match="needs quantization_calibration_tokens > 0"):
        EngineArgs(quantization="int4", quantization_calibration_file=__file__)
    with pytest.raises(ValueError, match="is not a file"):
        EngineArgs(quantization="w4a8", quantization_calibration_tokens=256, quantization_calibration_file="/no/such")
