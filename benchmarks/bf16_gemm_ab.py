"""The bf16 panel linear kernel against another version of its source, in one process, calls alternating.

Why: on this shared VM, compute and bandwidth swing by up to 1.6x from one minute (or process) to the next,
so only two builds timed call by call under the same load can be compared. Builds `--old-source` (e.g.
`git show REV:kvforge/models/csrc/linear_bf16.c > /tmp/old.c`) beside this tree's `linear_bf16.c`, with
the same flags, and times both:

- prefill: the 1B preset's (or with `--shapes smollm2` the default model's) four linear shapes (qkv 3,072 x 2,048, o 2,048 x 2,048, fused gate/up
  16,384 x 2,048, down 2,048 x 8,192) at `--prefill-rows` rows (a 1,024-token chunk by default), best of
  `--repeats`, as GFLOP/s;
- a step: every linear of `--layers` layers of those shapes (the model's count by default: 1.95 GB of
  distinct bf16 weights at 1B, which stream from DRAM as in a decode step; the default model's 0.21 GB
  stay in a 32 MiB L3 only in part) at each of `--rows`, per round old then new, printing the
  median time, the weights' GB/s and the median of the per-round ratios old/new with its range.

The weights are first moved onto fresh 2 MiB pages, as an engine's load does (`--no-weight-pages`: left where
packing put them). Outputs are checked equal (the kernel's results do not depend on its prefetches). The GEMM tile is this
CPU's choice unless `--mode dot|fma` forces one in both builds.

`--gated` adds this tree's fused gate|up + SiLU-and-multiply call (`panel_linear_silu_mul`) against its two
calls (`panel_linear`, then `fused.silu_mul`) on `--layers` of the preset's gate|up weights at each of
`--gated-rows`, per round two calls then fused (the old source is not used there).

    git show HEAD~1:kvforge/models/csrc/linear_bf16.c > /tmp/old.c
    python benchmarks/bf16_gemm_ab.py --old-source /tmp/old.c
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from kvforge.models import panel_linear as pl
from kvforge.models.weight_pages import settle_weight_pages
from kvforge.native import NativeLibrary

# (N, K) of qkv, o, gate|up, down, and the layer count
PRESETS = {"1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16),  # benchmarks/random_llama.py
           "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30)}  # the default model


def call(lib, x: torch.Tensor, pw: pl.PanelWeight, y: torch.Tensor, threads: int) -> None:  # type: ignore[no-untyped-def]
    lib.kvf_panel_linear_bf16(x.data_ptr(), x.shape[0], pw.k, pw.packed.data_ptr(), pw.n, None, y.data_ptr(), threads)


def declare_old(lib) -> None:  # type: ignore[no-untyped-def]
    """Only what this benchmark calls: an older source need not have the newer entry points."""
    P, I, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kvf_panel_linear_bf16.restype = None
    lib.kvf_panel_linear_bf16.argtypes = [P, I, I, P, I, P, P, C]
    lib.kvf_panel_bf16_gemm_mode.restype = C
    lib.kvf_panel_bf16_gemm_mode.argtypes = []
    lib.kvf_panel_bf16_set_gemm_mode.restype = C
    lib.kvf_panel_bf16_set_gemm_mode.argtypes = [C]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-source", type=Path, required=True, help="the old linear_bf16.c")
    ap.add_argument("--prefill-rows", type=int, default=1024)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64], help="rows of the step A/B")
    ap.add_argument("--shapes", choices=sorted(PRESETS), default="1b", help="whose linear shapes")
    ap.add_argument("--layers", type=int, default=None, help="layers in the step A/B (default: the model's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mode", choices=["auto", "dot", "fma"], default="auto")
    ap.add_argument("--weight-pages", action=argparse.BooleanOptionalAction, default=True,
                    help="move the weights onto fresh 2 MiB pages first, as an engine's load does (default: on)")
    ap.add_argument("--gated", action="store_true", help="also time the fused gate|up + SiLU call against two calls")
    ap.add_argument("--gated-rows", type=int, nargs="+", default=[1, 16, 128, 1024])
    args = ap.parse_args()
    threads = torch.get_num_threads()
    libs = {"old": NativeLibrary(args.old_source.resolve(), "KVFORGE_PANEL_LINEAR", "the old bf16 panel kernel",
                                 declare_old), "new": pl.LIBRARY_BF16}
    for name, library in libs.items():
        lib = library.load()
        assert lib is not None, f"{name}: {library.error}"
        lib.kvf_panel_bf16_set_gemm_mode(pl.BF16_GEMM_MODES[args.mode])
    loaded = {name: library.load() for name, library in libs.items()}
    mode = {name: pl.BF16_GEMM_NAMES[lib.kvf_panel_bf16_gemm_mode()] for name, lib in loaded.items()}
    print(f"{threads} threads; GEMM tile old {mode['old']}, new {mode['new']}")
    shapes, num_layers = PRESETS[args.shapes]
    args.layers = args.layers or num_layers
    torch.manual_seed(0)
    layers = [[pl.pack_panels((torch.randn(n, k) * 0.02).bfloat16()) for n, k in shapes] for _ in range(args.layers)]
    if args.weight_pages:  # where an engine's weights sit since 0696115 (models/weight_pages.py)
        holder = torch.nn.Module()
        for i, pw in enumerate(pw for layer in layers for pw in layer):
            setattr(holder, f"w{i}", pw)
        print(f"weights: {settle_weight_pages(holder).describe()}")

    # prefill shapes: best of the repeats, calls alternating
    m = args.prefill_rows
    xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in shapes}}
    print(f"\nprefill, {m} rows: ms (GFLOP/s), best of {args.repeats}")
    total = {name: 0.0 for name in loaded}
    for pw in layers[0]:
        ys = {name: torch.empty(m, pw.n, dtype=torch.bfloat16) for name in loaded}
        best = {name: float("inf") for name in loaded}
        for _ in range(args.repeats):
            for name, lib in loaded.items():
                t = time.perf_counter()
                call(lib, xs[pw.k], pw, ys[name], threads)
                best[name] = min(best[name], time.perf_counter() - t)
        assert torch.equal(ys["old"], ys["new"]), f"outputs differ at N={pw.n} K={pw.k}"
        flop = 2 * m * pw.n * pw.k
        cells = "  ".join(f"{name} {best[name] * 1e3:7.2f} ({flop / best[name] / 1e9:4.0f})" for name in loaded)
        print(f"  N={pw.n:>5} K={pw.k:>4}  {cells}  old/new {best['old'] / best['new']:.3f}x")
        for name in loaded:
            total[name] += best[name]
    flop = sum(2 * m * n * k for n, k in shapes)
    print(f"  all four        " + "  ".join(f"{name} {total[name] * 1e3:7.2f} ({flop / total[name] / 1e9:4.0f})"
                                             for name in loaded) + f"  old/new {total['old'] / total['new']:.3f}x")

    # a step's linears over every layer (weights from DRAM), per round old then new
    gb = sum(pw.nbytes for layer in layers for pw in layer) / 1e9
    print(f"\na step's linears, {args.layers} layers ({gb:.2f} GB of weights): median ms (weight GB/s), "
          f"old/new per round: median [range]")
    for rows in args.rows:
        xr = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in shapes}}
        yr = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in shapes}
        times: dict[str, list[float]] = {name: [] for name in loaded}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for name, lib in loaded.items():
                t = time.perf_counter()
                for layer in layers:
                    for pw in layer:
                        call(lib, xr[pw.k], pw, yr[pw.n], threads)
                times[name].append(time.perf_counter() - t)
        ratios = sorted(o / n for o, n in zip(times["old"][1:], times["new"][1:]))
        cells = "  ".join(f"{name} {statistics.median(times[name][1:]) * 1e3:7.1f} "
                          f"({gb / statistics.median(times[name][1:]):4.1f})" for name in loaded)
        print(f"  {rows:>4} rows  {cells}  old/new {statistics.median(ratios):.3f}x "
              f"[{ratios[0]:.3f}-{ratios[-1]:.3f}]")

    if args.gated:
        gated_ab(layers, args.gated_rows, args.repeats)


def gated_ab(layers: list[list[pl.PanelWeight]], rows_list: list[int], repeats: int) -> None:
    """This tree's fused gate|up + SiLU call against its two calls, per round the two calls then fused."""
    from kvforge.models import fused

    gate_up = [layer[2] for layer in layers]
    print(f"\ngate|up + SiLU over {len(gate_up)} layers: median ms, two calls / fused per round: median [range]")
    for rows in rows_list:
        x = torch.randn(rows, gate_up[0].k).bfloat16()
        assert torch.equal(pl.panel_linear_silu_mul(x, gate_up[0]), fused.silu_mul(pl.panel_linear(x, gate_up[0])))
        two: list[float] = []
        one: list[float] = []
        for _ in range(repeats + 1):  # the first round warms up and is dropped
            t = time.perf_counter()
            for w in gate_up:
                fused.silu_mul(pl.panel_linear(x, w))
            two.append(time.perf_counter() - t)
            t = time.perf_counter()
            for w in gate_up:
                pl.panel_linear_silu_mul(x, w)
            one.append(time.perf_counter() - t)
        ratios = sorted(a / b for a, b in zip(two[1:], one[1:]))
        print(f"  {rows:>4} rows  two calls {statistics.median(two[1:]) * 1e3:8.1f}  fused "
              f"{statistics.median(one[1:]) * 1e3:8.1f}  {statistics.median(ratios):.3f}x "
              f"[{ratios[0]:.3f}-{ratios[-1]:.3f}]")


if __name__ == "__main__":
    main()
