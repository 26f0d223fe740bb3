"""`kvforge plan --bandwidth`: the decode roofline (issue 18), checked against the seed's Llama-3-8B figures."""
from __future__ import annotations

import json

import pytest

from kvforge.cli import main
from kvforge.planner.roofline import BANDWIDTH_PRESETS, DecodeRoofline, resolve_bandwidth


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama3_8b_reads_512_mib_of_kv_per_sequence_per_step_at_4k(capsys):
    doc = _plan_json(capsys, "--model", "llama-3-8b", "--seq-len", "4096", "--batch", "1", "--bandwidth", "h100")
    roof = doc["decode_roofline"]["configs"][0]
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes (bf16) = 128 KiB per token; x 4096 tokens
    assert roof["kv_bytes_per_seq"] == 2 * 32 * 8 * 128 * 2 * 4096 == 512 * 2**20
    weights = doc["configs"][0]["weights_bytes"]
    assert roof["bytes_per_step"] == weights + 512 * 2**20
    assert roof["step_seconds"] == pytest.approx((weights + 2**29) / 3.35e12)
    assert roof["tokens_per_s"] == pytest.approx(3.35e12 / (weights + 2**29))


def test_batch_multiplies_kv_not_weights():
    r1 = DecodeRoofline(2e12, 16e9, 2**29, 4096, 1)
    r32 = DecodeRoofline(2e12, 16e9, 2**29, 4096, 32)
    assert r32.bytes_per_step - r1.bytes_per_step == 31 * 2**29
    assert r32.step_seconds == pytest.approx((16e9 + 32 * 2**29) / 2e12)
    assert r32.tokens_per_s == pytest.approx(32 / r32.step_seconds)
    assert r32.tokens_per_s > r1.tokens_per_s  # batching amortizes the weight read


def test_bandwidth_specs():
    assert resolve_bandwidth("H100") == ("h100", BANDWIDTH_PRESETS["h100"])
    assert resolve_bandwidth("3.35TB/s")[1] == 3.35e12
    assert resolve_bandwidth("cpu", lambda: 12.5e9) == ("cpu, measured", 12.5e9)
    with pytest.raises(ValueError, match="--bandwidth"):
        resolve_bandwidth("fast")


def test_table_and_bad_flag(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--bandwidth", "3.35TB/s"]) == 0
    out = capsys.readouterr().out
    assert "decode roofline at 3.35 TB/s" in out and "512.00 MiB" in out and "tokens/s <=" in out
    assert main(["plan", "--bandwidth=-1GB/s"]) == 2
    assert "--bandwidth" in capsys.readouterr().err
