"""benchmarks/kv_block_size.py: both modes print a row per block size, and bad sizes are usage errors."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiny_models import VOCAB, build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "kv_block_size.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def rows(out: str) -> dict[int, list[str]]:
    """The table's rows by block size (lines that start with one)."""
    return {int(cols[0]): cols for cols in (ln.split() for ln in out.splitlines()) if cols and cols[0].isdigit()}


def test_the_kernel_table_has_every_size_with_a_time_and_a_ratio(tmp_path) -> None:  # type: ignore[no-untyped-def]
    save = tmp_path / "kernel.txt"
    proc = run("--batch", "2", "--len", "64", "--layers", "2", "--repeats", "2", "--sizes", "16", "32",
               "--save", str(save))
    assert proc.returncode == 0, proc.stderr
    table = rows(proc.stdout)
    assert sorted(table) == [16, 32]
    assert all(len(cols) == 7 and float(cols[1]) > 0 and float(cols[4]) > 0 for cols in table.values())
    assert table[16][3] == "1.00x"  # 16-token blocks, shuffled: the base
    assert save.read_text().strip() == proc.stdout.strip()


@pytest.mark.parametrize("args, message", [
    (["--len", "100", "--sizes", "16", "64"], "multiple of every block size"),
    (["--sizes", "0"], "must be positive"),
    (["--engine", "--model", "x", "--model-size", "1b"], "give one"),
    (["--engine", "--tables"], "--engine and --tables: give one"),
    (["--tables", "--every", "0"], "--every must be positive"),
    (["--engine", "--rounds", "0"], "--rounds must be positive"),
    (["--repeats", "0"], "--repeats must be positive"),
    (["--engine", "--model-size", "7b"], "invalid choice: '7b'"),
])
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    proc = run(*args)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.slow  # two engine child processes
def test_the_engine_table_runs_the_workload_once_per_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = str(tmp_path / "tiny")
    build_tiny_model(model, max_position_embeddings=4096)
    proc = run("--engine", "--model", model, "--workload", "batch", "--scale", "0.05", "--rounds", "1",
               "--vocab", str(VOCAB), "--sizes", "16", "64")
    assert proc.returncode == 0, proc.stderr
    table = rows(proc.stdout)
    assert sorted(table) == [16, 64] and table[16][5] == "1.000x"
    assert all(float(cols[2]) > 0 for cols in table.values())  # output tok/s
    assert proc.stderr.count("round 1/1") == 2


def test_the_tables_report_how_often_the_next_block_follows_in_the_pool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = str(tmp_path / "tiny")
    build_tiny_model(model, max_position_embeddings=4096)
    proc = run("--tables", "--model", model, "--workload", "batch", "--scale", "0.1", "--every", "1",
               "--vocab", str(VOCAB))
    assert proc.returncode == 0, proc.stderr
    steps = [ln.split() for ln in proc.stdout.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert steps, proc.stdout
    for step, seqs, pairs, share in steps:
        assert int(seqs) >= 1 and int(pairs) >= 1 and 0 <= int(share.rstrip("%")) <= 100
    assert int(steps[0][0]) == 1  # every step printed with --every 1 (a step with no block pair is left out)
