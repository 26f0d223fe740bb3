"""benchmarks/batch_steps.py: its floors and buckets on made-up steps, and a run on a tiny model whose buckets add
up to the whole."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiny_models import build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import batch_steps  # noqa: E402


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by name (the columns after the name)."""
    out = {}
    for line in text.splitlines()[1:]:
        name, cells = line[:30].strip(), line[30:].split()
        out[name] = cells
    return out


def test_floors_are_the_larger_of_reading_the_weights_and_the_flops() -> None:
    steps = [
        # a mixed step: 1,000 tokens of FLOPs (1 GFLOP each at 100 GFLOP/s: 10 s) beat reading 1 GB at 10 GB/s
        batch_steps.Step(prefill_tokens=990, decode_rows=10, sampled=12, seconds=20.0),
        # one decode row: the weights (0.1 s) beat its FLOPs (1 + 0.5 GFLOP at 100: 0.015 s)
        batch_steps.Step(prefill_tokens=0, decode_rows=1, sampled=1, seconds=0.2),
        # 30 rows: 30 x 1.5 GFLOP at 100 GFLOP/s = 0.45 s
        batch_steps.Step(prefill_tokens=0, decode_rows=30, sampled=30, seconds=0.9),
        # past the last bounded bucket: 300 x 1.5 GFLOP = 4.5 s
        batch_steps.Step(prefill_tokens=0, decode_rows=300, sampled=300, seconds=9.0),
    ]
    table = rows(batch_steps.report(steps, weight_bytes=10**9, bandwidth_gbs=10.0, flops=(10**9, 5 * 10**8, 0),
                                    rate_gflops=100.0))
    mixed = table["mixed (prefill + decode rows)"]
    # n, s, share, ms/step, ms/token, floor s, of floor
    assert mixed[0] == "1" and float(mixed[1]) == 20.0
    assert float(mixed[5]) == pytest.approx(1000 * 1e9 / 100e9 + 12 * 0.5e9 / 100e9, abs=0.01)  # 10.06 s
    assert mixed[6] == "50%"
    one = table["decode 1-4 rows"]
    assert float(one[5]) == pytest.approx(0.1, abs=0.01) and one[6] == "50%"
    thirty = table["decode 25-32 rows"]
    assert float(thirty[5]) == pytest.approx(0.45, abs=0.01) and thirty[6] == "50%"
    assert "decode 5-8 rows" not in table  # empty buckets are left out
    many = table["decode 65+ rows"]  # the open-ended bucket: no step falls outside every bucket
    assert many[0] == "1" and float(many[5]) == pytest.approx(4.5, abs=0.01)
    whole = table["all"]
    assert whole[0] == "4" and float(whole[1]) == pytest.approx(30.1)


def test_unread_rows_skip_the_last_layers_linears(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A Llama computes its last layer past the K/V projections on the read rows alone (models/output_rows.py):
    the floor counts those FLOPs once per read row, not per row, and not at all with KVFORGE_LAST_LAYER_ROWS=0."""
    import torch

    from kvforge import LLM

    model_dir = str(tmp_path / "tiny")
    build_tiny_model(model_dir)
    net = LLM(model=model_dir, num_kv_blocks=16, log_ledger=False).engine.model
    layer, head, skipped = batch_steps.linear_flops(net)
    last = net.model.layers[-1]
    linears = [m for m in last.modules() if isinstance(m, torch.nn.Linear)]
    expect = sum(2 * m.in_features * m.out_features for m in linears if m is not last.self_attn.qkv_proj)
    assert skipped == expect and 0 < skipped < layer
    assert head == 2 * net.lm_head.in_features * net.lm_head.out_features
    step = batch_steps.Step(prefill_tokens=100, decode_rows=4, sampled=5, seconds=1.0)
    assert batch_steps.step_flops(step, (layer, head, skipped)) == 104 * layer - 99 * skipped + 5 * head
    monkeypatch.setenv("KVFORGE_LAST_LAYER_ROWS", "0")  # envs reads the environment at each access
    assert batch_steps.linear_flops(net)[2] == 0


def test_the_bf16_peak_probe_measures_where_the_cpu_has_avx512_bf16() -> None:
    with open("/proc/cpuinfo") as f:
        has = "avx512_bf16" in f.read()
    peak = batch_steps.bf16_peak_gflops(1, rounds=1)
    if has:
        assert peak is not None and 10 < peak < 10_000  # one core: tens to hundreds of GFLOP/s
    else:
        assert peak is None


def test_a_tiny_run_traces_every_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = str(tmp_path / "tiny")
    build_tiny_model(model, max_position_embeddings=4096)
    save = tmp_path / "steps.txt"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "batch_steps.py"), "--model", model,
                           "--dtype", "float32", "--scale", "0.25", "--save", str(save)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert save.read_text().strip() == proc.stdout.strip()
    table = rows(proc.stdout.split("\n", 2)[2])
    assert "mixed (prefill + decode rows)" in table and "all" in table
    buckets = [cells for name, cells in table.items() if name != "all"]
    assert sum(int(c[0]) for c in buckets) == int(table["all"][0])
    assert sum(float(c[1]) for c in buckets) == pytest.approx(float(table["all"][1]), abs=0.02 * len(buckets))


def test_model_and_model_size_together_are_refused() -> None:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "batch_steps.py"), "--model", "x",
                           "--model-size", "1b"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and "--model or --model-size" in proc.stderr
