"""Each planner lint fires on the mistake it names, with the number that shows it, and stays quiet otherwise."""
from __future__ import annotations

import json

import pytest

from kvforge.ledger import KVCacheFormat
from kvforge.planner import lints
from kvforge.planner.capacity import PlanOptions, activation_bytes, build_column, prefill_transient
from kvforge.planner.prefix import load_prompts, prefix_cache_lint, split_head
from kvforge.planner.presets import PRESETS

GiB, MiB = 1024**3, 1024**2
BF16 = KVCacheFormat.uniform("bfloat16")


def column(preset="llama-3-8b", cfg=None, **opts):
    cfg = cfg if cfg is not None else dict(PRESETS[preset])
    return build_column(preset, preset, cfg, BF16, "bfloat16", PlanOptions(**opts))


# ---- missing num_key_value_heads -------------------------------------------------------------

def test_missing_kv_heads_in_gqa_family_says_how_many_times_larger():
    cfg = dict(PRESETS["llama-3-8b"])
    del cfg["num_key_value_heads"]
    lint = lints.missing_kv_heads(column(cfg=cfg))
    assert lint is not None and lint.severity == "warning"
    assert lint.numbers == {"kv_heads_read": 32, "typical_kv_heads": 8, "times_larger": 4.0}
    assert "512.00 KiB/token" in lint.message and "128.00 KiB/token" in lint.message and "4x smaller" in lint.message


def test_missing_kv_heads_quiet_when_stated_or_not_a_gqa_family():
    assert lints.missing_kv_heads(column("llama-2-7b")) is None  # MHA, but stated explicitly
    cfg = {**PRESETS["llama-2-7b"], "model_type": "gpt_neox"}
    del cfg["num_key_value_heads"]
    assert lints.missing_kv_heads(column(cfg=cfg)) is None
    assert lints.missing_kv_heads(column("deepseek-v2")) is None


# ---- max_model_len far above the workload ----------------------------------------------------

def test_max_model_len_waste_reports_unused_fraction_and_realistic_concurrency():
    col = column(gpu_memory=80 * GiB, max_model_len=131072, avg_seq_len=2000)
    lint = lints.max_model_len_waste(col, PlanOptions(max_model_len=131072, avg_seq_len=2000))
    assert lint is not None
    # 131072 tokens x 128 KiB = 16 GiB planned; 2000 tokens -> 125 blocks x 2 MiB = 250 MiB used
    assert lint.numbers["unused_fraction"] == pytest.approx(1 - 250 / (16 * 1024))
    assert lint.numbers["suggested_max_model_len"] == 4096
    kv = col.capacity.kv_memory
    assert lint.numbers["concurrency_at_max"] == kv // (16 * GiB) == 3
    assert lint.numbers["concurrency_at_suggested"] == kv // (512 * MiB)
    assert "98.5% reserved for nothing" in lint.message


def test_max_model_len_from_the_config_default_is_not_warned_about():
    """DeepSeek-V2's config says 163,840: the user never chose it, so no lint, even at a short workload."""
    col = column("deepseek-v2", avg_seq_len=2000)
    assert lints.model_max_len(col.cfg) == 163840
    assert lints.max_model_len_waste(col, PlanOptions(avg_seq_len=2000)) is None
    assert lints.max_model_len_waste(col, PlanOptions(max_model_len=163840, avg_seq_len=2000)) is not None


def test_max_model_len_close_to_workload_is_fine():
    assert lints.max_model_len_waste(column(), PlanOptions(max_model_len=8192, avg_seq_len=4096)) is None


# ---- offload that cannot help ----------------------------------------------------------------

def test_offload_cost_llama3_8b_4k_over_pcie4():
    col = column(seq_len=4096)
    lint = lints.offload_cost(col, PlanOptions(seq_len=4096), bandwidth=32e9, hbm_bandwidth=2e12)
    # 512 MiB / 32 GB/s = 16.8 ms per decoded token; GPU step reads 16.06 GB weights + 0.54 GB at 2 TB/s
    assert lint.numbers["transfer_ms_per_token"] == pytest.approx(512 * MiB / 32e9 * 1e3)
    assert lint.numbers["transfer_ms_per_token"] == pytest.approx(16.78, abs=0.01)
    assert lint.numbers["gpu_step_ms"] == pytest.approx((8_030_261_248 * 2 + 512 * MiB) / 2e12 * 1e3)
    assert lint.severity == "warning" and lint.code == "offload-cannot-help" and "16.8 ms" in lint.message


def test_offload_over_a_fast_link_is_only_info():
    lint = lints.offload_cost(column(), PlanOptions(seq_len=4096), bandwidth=900e9, hbm_bandwidth=2e12)
    assert lint.severity == "info" and lint.code == "offload-cost"


# ---- long prefill peak -----------------------------------------------------------------------

def test_activation_estimate_by_hand():
    # per token: 3 x 4096 + q/k/v (32 + 2 x 8) x 128 + 3 x 14336, in bf16; logits for min(T, seqs) rows
    per_token = (3 * 4096 + 48 * 128 + 3 * 14336) * 2
    assert activation_bytes(PRESETS["llama-3-8b"], 8192, 256, "bfloat16") == 8192 * per_token + 256 * 128256 * 4


def test_prefill_transient_mla_decompression_and_eager_scores():
    t = prefill_transient(PRESETS["deepseek-v2"], chunk=1024, context=32768, dtype="bfloat16")
    assert t["gathered_kv"] == 32768 * 128 * (128 + 64 + 128) * 2  # latent expanded to per-head K and V
    assert t["scores"] == 1024 * 32768 * 128 * 4


def test_prefill_peak_eager_does_not_fit_and_suggests_a_chunk():
    opts = PlanOptions(gpu_memory=80 * GiB, max_model_len=131072, attention="eager")
    lint = lints.prefill_peak(column(gpu_memory=80 * GiB, max_model_len=131072), opts)
    assert lint.severity == "warning" and lint.numbers["fits"] is False
    assert lint.numbers["scores"] == 8192 * 131072 * 32 * 4  # 128 GiB
    headroom = 80 * GiB - int(80 * GiB * 0.9)
    safe = lint.numbers["safe_max_num_batched_tokens"]
    assert safe * 131072 * 32 * 4 + lint.numbers["gathered_kv"] <= headroom
    assert 2 * safe * 131072 * 32 * 4 + lint.numbers["gathered_kv"] > headroom


def test_prefill_peak_fused_fits():
    opts = PlanOptions(gpu_memory=80 * GiB, max_model_len=131072)
    lint = lints.prefill_peak(column(gpu_memory=80 * GiB, max_model_len=131072), opts)
    assert lint.severity == "info" and lint.numbers["fits"] is True and lint.numbers["scores"] == 0
    assert lint.numbers["gathered_kv"] == 131072 * 2 * 8 * 128 * 2  # 512 MiB


# ---- prefix-cache killer ---------------------------------------------------------------------

SYSTEM = "You are the support assistant for ACME Corp. Answer politely and cite the manual. " * 30


def _prompts(head):
    return [head(i) + SYSTEM + f"User: question number {q}?" for i, q in enumerate(["one", "two", "three"])]


def test_timestamp_in_the_shared_head_kills_the_prefix_cache():
    prompts = _prompts(lambda i: f"Now: 2024-06-0{i + 1}T10:2{i}:13Z. ")
    lint = prefix_cache_lint(prompts, block_size=16, per_token_bytes=128 * 1024)
    assert lint is not None and lint.code == "prefix-cache-killer"
    assert lint.numbers["kind"] == "timestamp" and lint.numbers["reusable_tokens"] < 16
    assert lint.numbers["head_tokens"] >= len(SYSTEM) // 4  # ~4 characters per token
    assert lint.numbers["lost_blocks"] == lint.numbers["head_tokens"] // 16 - lint.numbers["reusable_tokens"] // 16
    assert "duplicate KV" in lint.message and "Move dynamic content" in lint.message


def test_request_id_in_the_head_is_named():
    lint = prefix_cache_lint(_prompts(lambda i: f"request {4711 + i * 13}: "), 16, 1.0)
    assert lint is not None and lint.numbers["kind"] == "number/id"
    uuids = _prompts(lambda i: f"session {['3f2b8c1e', '9a7d0e44', 'c0ffee12'][i]}-1234-4abc-8def-0123456789ab ")
    assert prefix_cache_lint(uuids, 16, 1.0).numbers["kind"] == "uuid"


def test_dynamic_content_after_the_head_is_fine():
    assert prefix_cache_lint(_prompts(lambda i: ""), 16, 1.0) is None  # only the user turn differs
    assert prefix_cache_lint([SYSTEM, SYSTEM], 16, 1.0) is None
    assert prefix_cache_lint(["one prompt"], 16, 1.0) is None
    assert split_head("the cat sat on the mat", "a dog ran to a log") is None  # coincidental spaces


def test_load_prompts_formats(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["a", "b"]))
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n"b"\n{"text": "c"}\n')
    (tmp_path / "p.txt").write_text("line one\nline two\n")
    (tmp_path / "multi.txt").write_text("first\nstill first\n---\nsecond\n")
    assert load_prompts(str(tmp_path / "p.json")) == ["a", "b"]
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["a", "b", "c"]
    assert load_prompts(str(tmp_path / "p.txt")) == ["line one", "line two"]
    assert load_prompts(str(tmp_path / "multi.txt")) == ["first\nstill first", "second"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="'prompt' or 'text'"):
        load_prompts(str(tmp_path / "bad.jsonl"))
