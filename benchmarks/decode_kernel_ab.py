"""The CPU decode kernel against another version of its source, in one process, calls alternating.

Why: on a shared machine, timings taken minutes apart in separate processes differ by 2x; two
builds timed call by call under the same load can be compared. Builds `--old-source` (e.g. a
`git show REV:kvforge/attention/csrc/paged_decode.c > old.c`) beside this tree's kernel and times
both on the layer of `quantized_decode.py` (3 KV heads x 64, 9 query heads, token scales; `--heads 8 32` for the
1B preset's 8 KV / 32 query heads), printing
min and median ms of each and old/new of the minima, and the largest output difference.

Each timed call walks `--layers` caches of that shape in turn, as a decode step walks its layers, so the
rows come from DRAM as they do in the engine; one cache alone (`--layers 1`) stays in a 32 MiB L3 at
small sizes and times the kernel's in-cache speed instead. Times are per layer.

    git show HEAD~3:kvforge/attention/csrc/paged_decode.c > /tmp/old.c
    OMP_NUM_THREADS=1 python benchmarks/decode_kernel_ab.py --old-source /tmp/old.c --batch 32 --len 512

Since the kernel is several units over `paged_common.h`, a revision from then on is given as its units (the
headers are found beside them; the shared `kvforge/csrc/include` headers are this tree's). Both builds get
this tree's flags (`cpu_kernel.IPA_CP_CLONES`):

    mkdir -p /tmp/old && git archive REV kvforge/attention/csrc | tar -x -C /tmp/old
    python benchmarks/decode_kernel_ab.py --old-source /tmp/old/kvforge/attention/csrc/paged_*.c

`--prefill` times the same file's prefill kernel instead, on a mixed step's prefill rows: four prompts'
chunks (256, 200, 250 and 301 tokens after 0, 0, 37 and 100 cached ones) of that shape, dense KV
(`--dtype`), `--layers` layers' caches per call, and prints the rate in useful GFLOP/s (causal pairs
x 9 heads x 256 FLOPs).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.cpu_paged import paged_attention_cpu
from kvforge.native import NativeLibrary
from quantized_decode import FORMATS, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-source", type=Path, nargs="+", required=True,
                    help="the old kernel: one file (before the decode/prefill split) or its units")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=8, help="caches walked per timed call (out of DRAM, as a step)")
    ap.add_argument("--heads", type=int, nargs=2, default=[3, 9], metavar=("KV", "Q"),
                    help="KV and query heads of 64 (the default model's; the 1B preset: 8 32)")
    ap.add_argument("--prefill", action="store_true", help="the prefill kernel on four prompts' chunks instead")
    args = ap.parse_args()
    libs = {"old": NativeLibrary(tuple(p.resolve() for p in args.old_source), "KVFORGE_CPU_KERNEL", "the old decode kernel",
                                 cpu_kernel._declare, cpu_kernel.IPA_CP_CLONES), "new": cpu_kernel.LIBRARY}
    for name, lib in libs.items():
        assert lib.load() is not None, f"{name}: {lib.error}"
    if args.prefill:
        prefill_ab(libs, args)
        return
    print(f"per layer over {args.layers} layers' caches, {args.batch} sequences x {args.len} tokens, "
          f"{args.heads[0]} KV / {args.heads[1]} query heads, "
          f"{args.repeats} alternating calls each, {torch.get_num_threads()} threads")
    print(f"{'compute':<9} {'KV format':<10} {'old min':>8} {'old med':>8} {'new min':>8} {'new med':>8} "
          f"{'old/new':>8} {'max diff':>9}")
    try:
        for dtype in args.dtype:
            for fmt in args.formats:
                layers = [build(fmt, "token", getattr(torch, dtype), args.batch, args.len, seed=i,
                                kv_heads=args.heads[0], heads=args.heads[1])
                          for i in range(args.layers)]
                times: dict[str, list[float]] = {k: [] for k in libs}
                outs = {}
                for _ in range(args.repeats + 1):
                    for name, lib in libs.items():
                        cpu_kernel.LIBRARY = lib  # what paged_decode loads at each call
                        start = time.perf_counter()
                        for q, cache, meta in layers:
                            outs[name] = paged_attention_cpu(q, cache, meta, 0.125)
                        times[name].append((time.perf_counter() - start) / len(layers))
                old, new = (sorted(times[k][1:]) for k in ("old", "new"))  # the first call warms up
                diff = (outs["old"].float() - outs["new"].float()).abs().max().item()
                print(f"{dtype:<9} {fmt:<10} {old[0] * 1e3:>8.2f} {statistics.median(old) * 1e3:>8.2f} "
                      f"{new[0] * 1e3:>8.2f} {statistics.median(new) * 1e3:>8.2f} {old[0] / new[0]:>7.2f}x "
                      f"{diff:>9.1e}", flush=True)
    finally:
        cpu_kernel.LIBRARY = libs["new"]


PREFILL_CHUNKS = [(0, 256), (0, 200), (37, 250), (100, 301)]  # (cached tokens, chunk tokens)


def prefill_ab(libs: dict, args: argparse.Namespace) -> None:
    from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
    from kvforge.kv.storage.dense import DenseKVCache

    pairs = sum(n * s + n * (n + 1) // 2 for s, n in PREFILL_CHUNKS)
    print(f"prefill, chunks (cached, new) {PREFILL_CHUNKS}, {args.layers} layers' caches per call, "
          f"{args.repeats} alternating calls each, {torch.get_num_threads()} threads")
    print(f"{'compute':<9} {'old ms':>8} {'new ms':>8} {'old/new':>8} {'old GFLOP/s':>12} {'new GFLOP/s':>12} {'max diff':>9}")
    try:
        for dtype in args.dtype:
            dt = getattr(torch, dtype)
            layers = []
            for seed in range(args.layers):
                g = torch.Generator().manual_seed(seed)
                cache = DenseKVCache(2048, 16, 3, 64, 64, dt)
                cache.k.copy_(torch.randn(cache.k.shape, generator=g))
                cache.v.copy_(torch.randn(cache.v.shape, generator=g))
                perm, chunks, row = torch.randperm(2048, generator=g), [], 0
                for c, (s, n) in enumerate(PREFILL_CHUNKS):
                    chunks.append(PrefillChunk(slice(row, row + n), s, s + n, perm[c * 32:(c + 1) * 32]))
                    row += n
                meta = AttentionMetadata(torch.zeros(row, dtype=torch.long), 0, torch.zeros(0, 1, dtype=torch.long),
                                         torch.zeros(0, dtype=torch.long), chunks)
                layers.append((torch.randn(row, 9, 64, generator=g).to(dt), cache, meta))
            times: dict[str, list[float]] = {k: [] for k in libs}
            outs = {}
            for _ in range(args.repeats + 1):
                for name, lib in libs.items():
                    cpu_kernel.LIBRARY = lib
                    start = time.perf_counter()
                    for q, cache, meta in layers:
                        outs[name] = paged_attention_cpu(q, cache, meta, 0.125)
                    times[name].append((time.perf_counter() - start) / len(layers))
            old, new = (min(times[k][1:]) for k in ("old", "new"))
            diff = (outs["old"].float() - outs["new"].float()).abs().max().item()
            flops = pairs * 9 * 256
            print(f"{dtype:<9} {old * 1e3:>8.3f} {new * 1e3:>8.3f} {old / new:>7.2f}x {flops / old / 1e9:>12.0f} "
                  f"{flops / new / 1e9:>12.0f} {diff:>9.1e}", flush=True)
    finally:
        cpu_kernel.LIBRARY = libs["new"]


if __name__ == "__main__":
    main()
