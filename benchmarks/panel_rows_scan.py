"""How a decoder layer's bf16 panel linears scale with the rows of a step, on the random 1B preset's shapes.

Why: a batch's decode steps run 1-32 rows as the batch fills and drains. At one row a step reads every weight
once and is bandwidth-bound; from ~12 rows it is compute-bound too. This prints, per row count, one layer's
four matmuls (qkv, o, gate|up, down) back to back: ms, GFLOP/s and the weights' GB/s, so the rows where
neither bound is reached show (each against max(bandwidth time at 1 row, compute time at the `vdpbf16ps`
peak)).

    python benchmarks/panel_rows_scan.py [--rows 1 4 8 12 16 24 32 64] [--peak-gflops 450]
"""
from __future__ import annotations

import argparse
import time

import torch

from kvforge.models.panel_linear import pack_panels, panel_linear

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}  # 1B preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 20, 24, 32, 48, 64])
    ap.add_argument("--peak-gflops", type=float, default=450.0, help="the multiply's peak (2-core Zen 4: ~450)")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = {k: pack_panels(torch.randn(n, kk).to(torch.bfloat16) * 0.02) for k, (n, kk) in SHAPES.items()}
    nbytes = sum(n * k * 2 for n, k in SHAPES.values())
    macs = sum(n * k for n, k in SHAPES.values())
    base = None
    print(f"{'rows':>4} {'ms/layer':>9} {'GFLOP/s':>8} {'GB/s':>6} {'of ideal':>8}")
    for m in args.rows:
        xs = {k: torch.randn(m, kk).to(torch.bfloat16) for k, (_, kk) in SHAPES.items()}

        def step() -> None:
            for k, w in weights.items():
                panel_linear(xs[k], w)

        for _ in range(3):
            step()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(4):
                step()
            best = min(best, (time.perf_counter() - t0) / 4)
        base = base if base is not None else best  # the first row count's time: the read bound
        ideal = max(base, 2 * m * macs / (args.peak_gflops * 1e9))
        print(f"{m:>4} {best * 1e3:>9.2f} {2 * m * macs / best / 1e9:>8.1f} {nbytes / best / 1e9:>6.1f} "
              f"{ideal / best:>7.0%}")


if __name__ == "__main__":
    main()
