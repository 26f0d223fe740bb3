"""The int8 / int4 linear kernel against another version of its source, in one process, calls alternating.

Why: on this shared VM the read bandwidth swings between ~28 and ~63 GB/s from one minute to the next, so
only two builds timed call by call under the same load can be compared. Builds `--old-source` (e.g.
`git show REV:kvforge/models/csrc/linear_quant.c > /tmp/old.c`) beside this tree's `linear_quant.c`, with
the same flags, and times both on a decode step's linears of the 1B preset (qkv 3,072 x 2,048, o 2,048 x
2,048, fused gate|up 16,384 x 2,048, down 2,048 x 8,192; `--layers` layers, each with its own codes, so they
stream from DRAM as in the engine: 0.97 GB at int8 for 16 layers). For each of `--rows`, each round calls
old then new over the whole step; printed: the best time of each, the codes' GB/s, and the median of the
per-round ratios old/new (> 1: new faster) with its range, and the largest output difference.

`--method` picks the codes: `int8` (per channel, weight-only), `int4` (groups of `--group`), `w8a8_int8` or
`w4a8`, quantized from the same random bf16 weights; x is bf16 (`--dtype float32` for fp32 rows).

    git show HEAD~1:kvforge/models/csrc/linear_quant.c > /tmp/old.c
    python benchmarks/quant_linear_ab.py --old-source /tmp/old.c --rows 1 4 8 32
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvforge.models import quant_linear as ql
from kvforge.native import NativeLibrary

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # benchmarks/random_llama.py's 1b preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-source", type=Path, required=True, help="the old linear_quant.c")
    ap.add_argument("--method", choices=["int8", "int4", "w8a8_int8", "w4a8"], default="int8")
    ap.add_argument("--group", type=int, default=32, help="int4 / w4a8 group size")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    libs = {"old": NativeLibrary(args.old_source.resolve(), "KVFORGE_PANEL_LINEAR", "the old int8/int4 kernel",
                                 ql._declare), "new": ql.LIBRARY}
    loaded = {name: library.load() for name, library in libs.items()}
    for name, lib in loaded.items():
        assert lib is not None, f"{name}: {libs[name].error}"
    dtype = getattr(torch, args.dtype)
    group = args.group if args.method in ("int4", "w4a8") else None
    torch.manual_seed(0)
    qws = [ql.quantize((torch.randn(n, k) * 0.02).bfloat16(), args.method, group)
           for _ in range(args.layers) for n, k in SHAPES]
    gb = sum(q.codes.numel() * q.codes.element_size() for q in qws) / 1e9
    print(f"{args.method} codes, {args.layers} layers of the 1B preset's linears ({gb:.2f} GB), {args.dtype} x, "
          f"{threads} threads; {args.rounds} rounds, old then new")
    print(f"{'rows':>4} {'old ms':>8} {'GB/s':>6} {'new ms':>8} {'GB/s':>6}  old/new median (range)   max |diff|")
    for rows in args.rows:
        xs = [torch.randn(rows, q.k).to(dtype) for q in qws]
        ys = {name: [torch.empty(rows, q.n, dtype=dtype) for q in qws] for name in loaded}

        def step(name: str) -> float:
            t = time.perf_counter()
            for q, x, y in zip(qws, xs, ys[name]):
                assert ql.kernel_call(loaded[name], x, q, None, y, threads) == 0, "out of memory"
            return time.perf_counter() - t

        for name in loaded:  # warm up
            step(name)
        times: dict[str, list[float]] = {name: [] for name in loaded}
        for _ in range(args.rounds):
            for name in ("old", "new"):
                times[name].append(step(name))
        ratios = [a / b for a, b in zip(times["old"], times["new"])]
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ys["old"], ys["new"]))
        best = {name: min(t) for name, t in times.items()}
        print(f"{rows:>4} {best['old'] * 1e3:8.1f} {gb / best['old']:6.1f} {best['new'] * 1e3:8.1f} "
              f"{gb / best['new']:6.1f}  {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
              f"   {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
