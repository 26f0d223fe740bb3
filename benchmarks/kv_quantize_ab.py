"""The KV quantize-on-write kernel against another version of its source, in one process, calls alternating.

Times `kvforge.kv.quant_kernel.quantize_rows` (int8 and fp8 e4m3, per-token scales, 3 KV heads x 64) on a
prefill chunk's rows (1,024) and a decode step's (32), bf16 and fp32 inputs, and checks that both builds
write the same codes and scales bit for bit.

    git show HEAD~1:kvforge/kv/csrc/kv_quantize.c > /tmp/kq_old.c
    python benchmarks/kv_quantize_ab.py --old-source /tmp/kq_old.c
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvforge.kv import quant_kernel
from kvforge.native import NativeLibrary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-source", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    libs = {"old": NativeLibrary(args.old_source.resolve(), "KVFORGE_KV_QUANT_KERNEL", "the old KV quantizer",
                                 quant_kernel._declare), "new": quant_kernel.LIBRARY}
    for name, lib in libs.items():
        assert lib.load() is not None, f"{name}: {lib.error}"
    print(f"{torch.get_num_threads()} threads, best of {args.repeats} alternating calls")
    try:
        for dtype in (torch.bfloat16, torch.float32):
            for fmt in ("int8", "fp8_e4m3"):
                for rows in (1024, 32):
                    g = torch.Generator().manual_seed(rows)
                    x = torch.randn(rows, 3, 64, generator=g).to(dtype)
                    slots = torch.randperm(8192, generator=g)[:rows]
                    codes = {k: torch.zeros(8192, 3, 64, dtype=torch.uint8) for k in libs}
                    scales = {k: torch.zeros(8192) for k in libs}
                    times: dict[str, list[float]] = {k: [] for k in libs}
                    for _ in range(args.repeats):
                        for name, lib in libs.items():
                            quant_kernel.LIBRARY = lib  # what quantize_rows loads at each call
                            start = time.perf_counter()
                            quant_kernel.quantize_rows(x, slots, codes[name], scales[name], fmt, "token")
                            times[name].append(time.perf_counter() - start)
                    same = torch.equal(codes["old"], codes["new"]) and torch.equal(scales["old"], scales["new"])
                    old, new = min(times["old"]), min(times["new"])
                    print(f"{str(dtype).removeprefix('torch.'):<9} {fmt:<9} {rows:>5} rows: old {old * 1e6:7.1f} us"
                          f"  new {new * 1e6:7.1f} us  {old / new:5.2f}x  bitwise same: {same}", flush=True)
    finally:
        quant_kernel.LIBRARY = libs["new"]


if __name__ == "__main__":
    main()
