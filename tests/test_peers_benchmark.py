"""benchmarks/peers.py without OpenVINO: it skips the peer with a message, runs kvforge, and `--repeats`
reports each configuration's median run with its spread. (The peer itself is never needed by the tests.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_repeats_below_one_is_a_usage_error(tiny: str) -> None:
    proc = run("--engines", "kvforge", "--repeats", "0", "--model", tiny)
    assert proc.returncode == 2 and "--repeats must be at least 1, got 0" in proc.stderr
