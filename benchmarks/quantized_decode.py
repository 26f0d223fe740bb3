"""Decode attention over a compressed KV cache, per layer: read in place vs gather + dequantize.

One layer of the default model's shape (3 KV heads x 64, 9 query heads) holding B sequences of L
tokens in scattered blocks, far larger than the CPU caches. For each stored format it times
- `in place`: the CPU decode kernel reading codes and scales where they lie (what the engine runs now);
- `gather`: what quantized caches ran before: gather every block, dequantize into the model dtype,
  then attend (the SDPA backend's decode).
Both in the compute dtype given; fp32/bf16 rows are the 16/32-bit baselines (no dequantization).

    python benchmarks/quantized_decode.py [--batch 16] [--len 2048] [--dtype float32 bfloat16]
        [--formats float32 bfloat16 int8 ...] [--no-gather]

`in place / 16-bit` compares each row with the bfloat16-KV row of the same compute dtype (the issue's
"8-bit KV at least as fast as 16-bit" target); `--no-gather` skips the slow gather column.
"""
from __future__ import annotations

import argparse
import time

import torch

from kvforge.attention.cpu_paged import paged_attention_cpu
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.sdpa import paged_attention_sdpa
from kvforge.kv.storage.quantized import QuantizedKVCache

FORMATS = ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]


def build(fmt: str, gran: str, compute: torch.dtype, batch: int, length: int, bs: int = 16, seed: int = 0,
          kv_heads: int = 3, heads: int = 9):
    """One layer's cache of `fmt` rows (the default model's 3 KV / 9 query heads of 64 unless given), its
    blocks shuffled in the pool, with one decode query per sequence."""
    g = torch.Generator().manual_seed(seed)
    nb = length // bs
    cache = QuantizedKVCache(batch * nb + 1, bs, kv_heads, 64, 64, fmt, fmt, gran, compute)
    slots = torch.arange(bs, (batch * nb + 1) * bs)
    for s in range(0, slots.numel(), 4096):  # filled in chunks: per-channel scales see whole blocks
        part = slots[s:s + 4096]
        cache.write(part, torch.randn(part.numel(), kv_heads, 64, generator=g),
                    torch.randn(part.numel(), kv_heads, 64, generator=g))
    tables = (torch.randperm(batch * nb, generator=g) + 1).view(batch, nb)
    meta = AttentionMetadata(torch.zeros(batch, dtype=torch.long), batch, tables, torch.full((batch,), length))
    q = torch.randn(batch, heads, 64, generator=g).to(compute)
    return q, cache, meta


def best_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    ap.add_argument("--no-gather", action="store_true", help="time only the in-place kernel")
    args = ap.parse_args()
    print(f"one layer, {args.batch} sequences x {args.len} tokens, 3 KV heads x 64, best of {args.repeats}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'compute':<9} {'KV format':<10} {'KV MiB':>7} {'in place ms':>12} {'16-bit/in place':>16} "
          f"{'gather ms':>10} {'gather/in place':>16}")
    for dtype in args.dtype:
        compute = getattr(torch, dtype)
        # the 16-bit baseline first, whatever the order asked for
        formats = sorted(args.formats, key=lambda f: f != "bfloat16")
        base = None
        rows = {}
        for fmt in formats:
            q, cache, meta = build(fmt, "token", compute, args.batch, args.len)
            meta.backend = "cpu"
            inplace = best_ms(lambda: paged_attention_cpu(q, cache, meta, 0.125), args.repeats)
            gather = float("nan") if args.no_gather else best_ms(
                lambda: paged_attention_sdpa(q, cache, meta, 0.125), args.repeats)
            base = base or (inplace if fmt == "bfloat16" else None)
            rows[fmt] = (f"{dtype:<9} {fmt:<10} {cache.nbytes / 2**20:>7.1f} {inplace:>12.2f} "
                         f"{(base or float('nan')) / inplace:>15.2f}x {gather:>10.2f} {gather / inplace:>15.1f}x")
        for fmt in args.formats:
            print(rows[fmt], flush=True)


if __name__ == "__main__":
    main()
