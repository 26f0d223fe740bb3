"""benchmarks/weight_pages_ab.py: its copies keep the bytes, and a run on a small model prints both tables."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tiny_models import build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import weight_pages_ab  # noqa: E402


@pytest.mark.parametrize("advice", [14, 15])  # MADV_HUGEPAGE, MADV_NOHUGEPAGE
def test_a_copy_onto_new_pages_keeps_the_bytes_on_a_2mib_boundary(advice: int) -> None:
    t = torch.randn(3, 1 << 19).bfloat16()
    keep: list = []
    c = weight_pages_ab.copy_onto_pages(t, advice, keep)
    assert torch.equal(c, t) and c.data_ptr() % (2 << 20) == 0 and keep


def test_a_small_run_prints_both_rounds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvforge.models.panel_linear import available, simd

    if not (available(torch.bfloat16) and simd(torch.bfloat16)):
        pytest.skip("needs the AVX512-BF16 panel kernel (the benchmark times bf16 panels)")
    model = str(tmp_path / "small")
    build_tiny_model(model, hidden_size=512, intermediate_size=2048)  # gate|up: 4 MiB in bf16, moved by the settle
    save = tmp_path / "pages.txt"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "weight_pages_ab.py"), "--model", model,
                           "--rows", "1", "3", "--rounds", "2", "--save", str(save)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert save.read_text().strip() == proc.stdout.strip()
    out = proc.stdout
    assert "as loaded (KVFORGE_WEIGHT_PAGES=0)" in out and "after settle_weight_pages" in out
    tables = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("1", "3")]
    assert len(tables) == 4 and all(len(cells) == 6 for cells in tables)  # rows, 3 arms, 2 ratios
    settled = next(line for line in out.splitlines() if line.startswith("## the engine's weights after"))
    assert "moved onto fresh pages" in settled and not settled.split(": ", 1)[1].startswith("0 B of")
