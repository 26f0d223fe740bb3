"""benchmarks/peers.py without OpenVINO: it skips the peer with a message, runs kvforge, and `--repeats`
reports each configuration's median run with its spread. (The peer itself is never needed by the tests.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import VOCAB, build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "peers.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("peers_model"))
    build_tiny_model(path, max_position_embeddings=4096)
    return path


def test_repeats_report_the_median_run_and_skip_a_missing_peer(tiny: str, tmp_path) -> None:
    save = tmp_path / "peers.json"
    proc = run("--workloads", "single", "--dtype", "float32", "--kv", "model", "8bit", "--scale", "0.1",
               "--repeats", "3", "--model", tiny, "--vocab", str(VOCAB), "--save", str(save))
    assert proc.returncode == 0, proc.stderr
    assert "skipping OpenVINO GenAI" in proc.stderr  # no --openvino-model: the peer is skipped, said why
    assert proc.stderr.count("round ") == 6  # 2 configurations x 3 rounds, round-robin
    data = json.loads(save.read_text())
    assert data["repeats"] == 3 and [r["kv"] for r in data["rows"]] == ["model", "8bit"]
    for row in data["rows"]:
        runs = sorted(row["runs_out_tok_s"])
        assert len(runs) == 3 and row["out_tok_s"] == runs[1]  # the median run is the row
        assert f"{runs[0]:.1f}-{runs[-1]:.1f}" in proc.stdout  # and the table shows the spread
    assert "8bit KV / model-dtype KV" in proc.stdout
    # and the ratio round by round, pairing runs of the same round
    model, eight = data["rows"]
    assert model["runs_round"] == eight["runs_round"] == [1, 2, 3]
    ratios = [e / m for e, m in zip(eight["runs_out_tok_s"], model["runs_out_tok_s"])]
    line = next(ln for ln in proc.stdout.splitlines() if "8bit KV / model-dtype KV" in ln)
    assert line.endswith("(per round " + ", ".join(f"{x:.2f}x" for x in ratios) + ")"), line


def test_per_round_pairs_runs_of_the_same_round() -> None:
    """A failed run drops its round from the pairing instead of shifting the later rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from peers import per_round

    a = {"runs_out_tok_s": [100.0, 120.0], "runs_round": [1, 3]}
    b = {"runs_out_tok_s": [50.0, 80.0, 60.0], "runs_round": [1, 2, 3]}
    assert per_round(a, b) == [2.0, 2.0]


def test_repeats_below_one_is_a_usage_error(tiny: str) -> None:
    proc = run("--engines", "kvforge", "--repeats", "0", "--model", tiny)
    assert proc.returncode == 2 and "--repeats must be at least 1, got 0" in proc.stderr
