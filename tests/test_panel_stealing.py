"""Panels handed out from both ends (`csrc/include/kvf_steal.h`): however the threads share them, every panel is
computed once and by the same tile, so a kernel's output is bitwise the same for any thread count.

More threads than this machine's cores are preempted in the middle of their ranges, so the others take tiles
from their backs; a team of one thread asked for four (OMP_THREAD_LIMIT=1, in a subprocess) must take all
four ranges itself, three of them from the back."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvforge.models import panel_linear as pl
from kvforge.models import quant_linear as ql

pytestmark = pytest.mark.skipif(ql.LIBRARY.load() is None or pl.LIBRARY_BF16.load() is None,
                                reason="needs the CPU linear kernels (a C compiler)")

THREADS = (1, 2, 3, 7)
# (method, group): weight-only int8 / int4 decode rows, and the int8-activation kernels at every row count
FORMATS = [("int8", None), ("int4", 32), ("w8a8_int8", None), ("w4a8", 64)]


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_quantized_output_does_not_depend_on_threads(method: str, group: int | None, rows: int) -> None:
    torch.manual_seed(rows)
    n, k = 16 * 41 + 5, 256  # 42 panels, the last one partial
    qw = ql.quantize(torch.randn(n, k) * 0.05, method, group)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    want = ql.quant_linear(x, qw, num_threads=1)
    for threads in THREADS[1:]:
        assert torch.equal(ql.quant_linear(x, qw, num_threads=threads), want), (method, rows, threads)


@pytest.mark.parametrize("rows", [1, 5, 32, 130])
def test_bf16_output_does_not_depend_on_threads(rows: int) -> None:
    torch.manual_seed(rows)
    w = (torch.randn(16 * 29 + 3, 320) * 0.05).bfloat16()  # 30 panels: 10 groups of 3, the last one partial
    pw = pl.pack_panels(w)
    x = torch.randn(rows, 320, dtype=torch.bfloat16)
    want = pl.panel_linear(x, pw, num_threads=1)
    for threads in THREADS[1:]:
        assert torch.equal(pl.panel_linear(x, pw, num_threads=threads), want), (rows, threads)


@pytest.mark.parametrize("rows", [1, 32, 130])
def test_fused_gate_up_does_not_depend_on_threads(rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(2 * 16 * 10, 256) * 0.05).bfloat16()  # 10 gate panels: groups 3, 3, 3, 1
    pw = pl.pack_panels(gate_up)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    want = pl.panel_linear_silu_mul(x, pw, num_threads=1)
    if want is None:
        pytest.skip("no fused gate|up kernel in this build (AVX512-BF16)")
    for threads in THREADS[1:]:
        assert torch.equal(pl.panel_linear_silu_mul(x, pw, num_threads=threads), want), (rows, threads)


_TEAM_OF_ONE = """
import torch
from kvforge.models import panel_linear as pl, quant_linear as ql
torch.manual_seed(0)
x = torch.randn(3, 256, dtype=torch.bfloat16)
for method, group in (("int8", None), ("int4", 32), ("w8a8_int8", None), ("w4a8", 64)):
    qw = ql.quantize(torch.randn(16 * 41 + 5, 256) * 0.05, method, group)
    assert torch.equal(ql.quant_linear(x, qw, num_threads=4), ql.quant_linear(x, qw, num_threads=1)), method
pw = pl.pack_panels((torch.randn(16 * 29 + 3, 256) * 0.05).bfloat16())
assert torch.equal(pl.panel_linear(x, pw, num_threads=4), pl.panel_linear(x, pw, num_threads=1))
print("ok")
"""


def test_a_team_smaller_than_asked_covers_every_panel() -> None:
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    out = subprocess.run([sys.executable, "-c", _TEAM_OF_ONE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
