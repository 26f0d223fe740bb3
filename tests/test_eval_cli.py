"""`kvforge eval kv-quant` end to end on a tiny random model, shrunk to seconds."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvforge import LLM
from kvforge.cli import main
from kvforge.evaluation.kv_quant import Variant, corpus_token_ids
from kvforge.ledger import KVCacheFormat, kv_bytes_per_token, num_blocks_for_memory

SMALL = ["--contexts", "24,48", "--num-prompts", "2", "--prompt-tokens", "8", "--gen-tokens", "6"]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama_gqa")[0]


def test_json_rows_reference_first_with_ledger_capacity(model_path, capsys):
    rc = main(["eval", "kv-quant", "--model", model_path, "--formats", "fp8_e4m3,int8@channel,auto/int4",
               "--kv-cache-memory", "1MiB", "--capacity-seq-len", "64", "--json", *SMALL])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert [r["spec"] for r in rows] == ["auto", "fp8_e4m3", "int8@channel", "auto/int4"]
    ref = rows[0]
    assert (ref["k_dtype"], ref["v_dtype"], ref["scale"]) == ("float32", "float32", None)
    assert ref["kl"] == 0.0 and ref["step_agreement"] == 1.0 and ref["same_prefix"] == 1.0
    assert (rows[3]["k_dtype"], rows[3]["v_dtype"], rows[3]["scale"]) == ("float32", "int4", "token")
    llm = LLM(model=model_path, log_ledger=False, num_kv_blocks=16, dtype="float32")  # as the eval runs
    shape = llm.engine.model_config.kv_shape()
    for r in rows:
        fmt = KVCacheFormat(r["k_dtype"], r["v_dtype"], r["scale"])
        assert r["bytes_per_token"] == kv_bytes_per_token(shape, fmt, 16)
        assert r["blocks"] == num_blocks_for_memory(1 << 20, shape, 16, fmt) - 1  # less the pool's null block
        assert r["sequences"] == r["blocks"] // 4  # 64-token sequences, 16-token blocks
        assert set(r["perplexity"]) == {"24", "48"}
        assert all(math.isfinite(p) and p > 1 for p in r["perplexity"].values())
    for r in rows[1:]:
        assert r["kl"] > 0 and 0 <= r["step_agreement"] <= 1 and 0 <= r["same_prefix"] <= 1
    # the reference perplexity is the plain definition over the first 48 documentation tokens
    ids = corpus_token_ids(llm.tokenizer, 48)
    logp = llm.engine.prompt_logits(ids).log_softmax(-1)
    nll = -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert ref["perplexity"]["48"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_table_and_plot(model_path, capsys, tmp_path):
    png = tmp_path / "kv.png"
    assert main(["eval", "kv-quant", "--model", model_path, "--formats", "int4@head",
                 "--plot", str(png), *SMALL]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("cache (K/V @scales)"))
    for col in ("ppl@24", "ppl@48", "KL vs ref", "step agree", "same prefix", "seqs@2048", "x ref"):
        assert col in header
    assert any(line.startswith("fp32 ") for line in lines) and any(line.startswith("int4 @head") for line in lines)
    assert "concurrency at" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    (["--formats", "int3"], "--formats"),
    (["--formats", "int8@block"], "scale must be one of"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--contexts", "4000"], "max_model_len"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
])
def test_bad_input_exits_2_naming_the_flag(model_path, capsys, argv, message):
    assert main(["eval", "kv-quant", "--model", model_path, *SMALL, *argv]) == 2
    assert message in capsys.readouterr().err


def test_unparsable_contexts_and_missing_subcommand_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "kv-quant", "--contexts", "a,b"])
    assert exc.value.code == 2 and "--contexts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["eval"])
    assert exc.value.code == 2


def test_variant_specs():
    assert Variant.parse("auto/fp8@channel").engine_changes() == {
        "kv_cache_dtype": "auto", "k_cache_dtype": "auto", "v_cache_dtype": "fp8_e4m3", "kv_cache_scale": "channel",
        "kv_cache_rotation": "auto"}
    assert Variant.parse("int4").kv_cache_scale == "token"
    assert Variant.parse("int8:none").engine_changes()["kv_cache_rotation"] == "none"
    with pytest.raises(ValueError, match="--formats"):
        Variant.parse("a/b/c")
