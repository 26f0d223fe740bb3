"""Paged attention backends on this machine: reference vs SDPA vs the in-place CPU kernel, fp32 and bf16.

Shapes of the default model (9 query heads, 3 KV heads, head_dim 64): a decode
batch of 32 sequences with contexts U[100, 600), and one 200-token prefill chunk
after 300 cached tokens. Checks that the backends agree with the reference, then
times them (the `cpu` backend runs both in its in-place C kernels at this head size).

    python benchmarks/attention_backends.py
    python benchmarks/attention_backends.py --bf16-prefill   # bf16 prefill kernel: VDPBF16PS vs FMAs vs AMX

`--bf16-prefill` times the bf16 prefill kernel's ways to multiply (`cpu_kernel.set_bf16_fma` and
`set_bf16_amx`, which the bf16 panel kernel's load-time choice sets in an engine; AMX tiles only where
they run) on a 1,024-token chunk after 1,024 cached tokens, calls alternating, best of several, and prints
the largest difference from the VDPBF16PS loop.
"""
from __future__ import annotations

import argparse
import time

import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.attention.cpu_paged import paged_attention_cpu
from kvforge.attention.sdpa import paged_attention_sdpa
from kvforge.attention.torch_ref import paged_attention
from kvforge.kv.storage.dense import DenseKVCache

NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 2048, 16, 3, 64, 9


def timed(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    torch.manual_seed(0)
    print(f"{'dtype':<10} {'phase':<8} {'max diff':>10} {'torch ms':>9} {'sdpa ms':>8} {'cpu ms':>7}")
    for dtype in (torch.float32, torch.bfloat16):
        cache = DenseKVCache(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, HEAD_DIM, dtype)
        cache.k.normal_()
        cache.v.normal_()
        lens = torch.randint(100, 600, (32,))
        width = int((lens.max() + BLOCK - 1) // BLOCK)
        tables = torch.randperm(NUM_BLOCKS)[: 32 * width].view(32, width)
        decode = AttentionMetadata(torch.zeros(32, dtype=torch.long), 32, tables, lens, [])
        start, tq = 300, 200
        prefill = AttentionMetadata(
            torch.zeros(tq, dtype=torch.long), 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
            [PrefillChunk(slice(0, tq), start, start + tq, tables[0][: (start + tq + BLOCK - 1) // BLOCK])],
        )
        for phase, meta, q in (("decode", decode, torch.randn(32, HEADS, HEAD_DIM, dtype=dtype)),
                               ("prefill", prefill, torch.randn(tq, HEADS, HEAD_DIM, dtype=dtype))):
            ref = paged_attention(q, cache, meta, HEAD_DIM**-0.5)
            diff = max((ref.float() - fn(q, cache, meta, HEAD_DIM**-0.5).float()).abs().max().item()
                       for fn in (paged_attention_sdpa, paged_attention_cpu))
            t_ref, t_sdpa, t_cpu = (timed(lambda fn=fn: fn(q, cache, meta, HEAD_DIM**-0.5))
                                    for fn in (paged_attention, paged_attention_sdpa, paged_attention_cpu))
            print(f"{str(dtype)[6:]:<10} {phase:<8} {diff:>10.2e} {t_ref:>9.2f} {t_sdpa:>8.2f} {t_cpu:>7.2f}")


def bf16_prefill_ab(rounds: int = 7) -> None:
    """The bf16 prefill kernel on VDPBF16PS, on fp32 FMAs and (where they run) on AMX tiles, same chunk,
    calls alternating."""
    if not cpu_kernel.available():
        raise SystemExit(f"CPU kernel unavailable: {cpu_kernel.unavailable_reason()}")
    torch.manual_seed(0)
    start, tq = 1024, 1024
    cache = DenseKVCache(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, HEAD_DIM, torch.bfloat16)
    cache.k.normal_()
    cache.v.normal_()
    table = torch.randperm(NUM_BLOCKS)[: (start + tq) // BLOCK]
    meta = AttentionMetadata(torch.zeros(tq, dtype=torch.long), 0, torch.zeros(0, 1, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), [PrefillChunk(slice(0, tq), start, start + tq, table)])
    q = torch.randn(tq, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    before_fma, before_amx = cpu_kernel.bf16_fma(), cpu_kernel.bf16_amx()
    paths = {"VDPBF16PS": (False, False), "fp32 FMAs": (True, False)}
    if cpu_kernel.set_bf16_amx(True):
        paths["AMX tiles"] = (False, True)
    best, outs = {name: float("inf") for name in paths}, {}
    for _ in range(rounds):
        for name, (on_fma, on_amx) in paths.items():
            cpu_kernel.set_bf16_fma(on_fma)
            cpu_kernel.set_bf16_amx(on_amx)
            best[name] = min(best[name], timed(lambda: paged_attention_cpu(q, cache, meta, HEAD_DIM**-0.5), reps=3))
            outs[name] = paged_attention_cpu(q, cache, meta, HEAD_DIM**-0.5).float()
    cpu_kernel.set_bf16_fma(before_fma)
    cpu_kernel.set_bf16_amx(before_amx)
    # causal: token t sees start + t + 1 keys; QK and PV are 2 x 64 multiply-adds per key and query head
    flop = sum(start + t + 1 for t in range(tq)) * HEADS * 64 * 2 * 2
    print(f"bf16 prefill, {tq}-token chunk after {start} cached tokens, {torch.get_num_threads()} threads (best of {rounds})"
          + ("" if "AMX tiles" in paths else "; no AMX tiles here") + ":")
    for name in paths:
        diff = (outs[name] - outs["VDPBF16PS"]).abs().max().item()
        print(f"  {name:<10} {best[name]:7.2f} ms  {flop / best[name] / 1e6:6.1f} GFLOP/s  "
              f"VDPBF16PS / this {best['VDPBF16PS'] / best[name]:.2f}x  max |diff| vs VDPBF16PS {diff:.2e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bf16-prefill", action="store_true", help="the bf16 prefill kernel: VDPBF16PS vs fp32 FMAs vs AMX tiles")
    if ap.parse_args().bf16_prefill:
        bf16_prefill_ab()
    else:
        main()
