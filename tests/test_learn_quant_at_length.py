"""`kvforge learn quant-at-length` (issue 45) on a tiny random model: the table, the verdicts, the plot, bad input."""
from __future__ import annotations

import math

import pytest

from kvforge.cli import main
from kvforge.learn.common import make_engine
from kvforge.learn.quant_at_length import FormatRow, increase, measure, verdicts


def test_quick_lesson_prints_every_format_at_every_length(tiny_model_factory, capsys, tmp_path):
    path, _ = tiny_model_factory("llama_gqa")
    png = tmp_path / "q.png"
    assert main(["learn", "quant-at-length", "--quick", "--model", path, "--contexts", "64,200",
                 "--dtype", "float32", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for spec in ("unquantized", "fp8_e4m3@head:none", "fp8_e4m3@head", "bfloat16/fp8_e4m3@head:none", "int8:none",
                 "int8"):
        assert spec in out
    assert "+% @64" in out and "+% @200" in out and "the loss" in out
    assert png.stat().st_size > 0


def test_one_window_gives_every_length_and_the_reference_row_is_unquantized(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    engine = make_engine(path, "float32", enable_prefix_caching=False, block_size=16, num_kv_blocks=20)
    rows = measure(engine, (32, 128, 250), ("int4@head",))
    base, int4 = rows
    assert base.spec == "auto" and sorted(base.perplexity) == [32, 128, 250]
    assert all(math.isfinite(p) and p > 1 for p in base.perplexity.values())
    assert int4.bytes_per_token < base.bytes_per_token / 4  # 4-bit codes against fp32
    assert int4.perplexity[250] != base.perplexity[250]  # int4 on random weights moves the numbers
    again = measure(engine, (250,), ())[0]  # the 250-token prefix of the same text: the same perplexity
    assert again.perplexity[250] == pytest.approx(base.perplexity[250], rel=1e-6)


def test_verdicts_follow_the_numbers():
    base = FormatRow("auto", 8, {256: 10.0, 2048: 10.0})
    tok = FormatRow("fp8_e4m3@token", 4, {256: 10.1, 2048: 10.3})
    head = FormatRow("fp8_e4m3@head", 4, {256: 10.05, 2048: 10.1})
    split = FormatRow("bfloat16/fp8_e4m3@head", 6, {256: 10.0, 2048: 10.01})
    assert increase(tok, base, 2048) == pytest.approx(3.0)
    lines = verdicts([base, tok, head, split])
    assert "grows with length" in lines[0] and "the remedy holds here" in lines[3]
    assert "per-head scales help" in lines[4]
    worse = FormatRow("bfloat16/fp8_e4m3@head", 6, {256: 10.0, 2048: 10.3})
    assert "does not show" in verdicts([base, tok, head, worse])[3]
    plain = FormatRow("int8:none", 4, {256: 10.02, 2048: 10.03})
    rotated = FormatRow("int8", 4, {256: 10.0, 2048: 10.005})
    assert verdicts([base, plain, rotated])[-1].startswith(
        "calibrated Hadamard rotation (int8) at 2048 tokens: 0.05% against 0.30%")
    assert "the rotation helps" in verdicts([base, plain, rotated])[-1]
    assert "does not help" in verdicts([base, FormatRow("int8:none", 4, {256: 10.0, 2048: 10.0}), rotated])[-1]


def test_bad_input_exits_2(tiny_model_factory, capsys):
    assert main(["learn", "quant-at-length", "--formats", "fp9"]) == 2
    path, _ = tiny_model_factory("llama_gqa")
    assert main(["learn", "quant-at-length", "--model", path, "--contexts", "64,4096"]) == 2  # past max_model_len 512
    assert "--contexts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["learn", "quant-at-length", "--contexts", "64,x"])
    assert exc.value.code == 2
