"""One decode step's linear layers of the ~1B Llama of issue 41, bf16 panels vs int8 vs int4 codes, against
the machine's read bandwidth measured in the same process.

The model: hidden 2048, 16 layers, 32 query / 8 KV heads of 64, ffn 8192, vocabulary 49,152, tied lm_head
(qkv 3072 x 2048, o 2048 x 2048, gate|up 16384 x 2048, down 2048 x 8192 per layer; 2.14 GB in bf16).
Every layer has its own random weights, so a step streams them from memory as a real decode step does.
The lm_head is int8 weight-only under int4, w8a8_int8 and w4a8, as the engine keeps it.
For each format and row count the whole step (16 x 4 linears + lm_head) is timed, best of `--rounds`
(other processes share the cores), and reported as ms, the step's weight bytes over its time (GB/s),
and the speed-up over bf16. Activations are bf16 throughout (the model dtype on this CPU).

    python benchmarks/weight_quant_decode.py [--layers 16] [--rows 1 4 32] [--rounds 5] [--save FILE]
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import read_bandwidth_gbs  # noqa: E402

from kvforge.models.panel_linear import pack_panels, panel_linear  # noqa: E402
from kvforge.models.quant_linear import layer_method, quant_linear, quantize, simd_level  # noqa: E402

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS, HEAD = 2048, 8192, 49152, 32, 8, 64
LAYER_SHAPES = [((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN), (HIDDEN, HEADS * HEAD), (2 * FFN, HIDDEN), (HIDDEN, FFN)]


def build(layers: int, group: int) -> dict[str, list]:
    """Each weight in the three layouts, made one at a time so only one dense bf16 copy is alive."""
    torch.manual_seed(0)
    out: dict[str, list] = {"bf16": [], "int8": [], "w8a8_int8": [], f"int4 g{group}": [], f"w4a8 g{group}": []}
    shapes = [s for _ in range(layers) for s in LAYER_SHAPES] + [(VOCAB, HIDDEN)]
    for i, (n, k) in enumerate(shapes):
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        name = "lm_head" if i == len(shapes) - 1 else f"layers.{i // 4}.proj"
        out["bf16"].append(pack_panels(w))
        out["int8"].append(quantize(w, "int8"))
        for method, fmt in (("w8a8_int8", "w8a8_int8"), ("int4", f"int4 g{group}"), ("w4a8", f"w4a8 g{group}")):
            # as the engine quantizes it: the lm_head stays weight-only int8 (`layer_method`)
            out[fmt].append(out["int8"][-1] if layer_method(method, name) == "int8" else quantize(w, method, group))
    return out


def step(fmt: str, weights: list, xs: dict[int, torch.Tensor], rows: int) -> float:
    t0 = time.perf_counter()
    for w in weights:
        x = xs[w.k][:rows]
        if fmt == "bf16":
            panel_linear(x, w)
        else:
            quant_linear(x, w)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--group", type=int, default=32, help="int4 group size")
    ap.add_argument("--save", help="also write the table to this file")
    args = ap.parse_args()
    buf = io.StringIO()
    with redirect_stdout(buf):
        pass
    weights = build(args.layers, args.group)
    xs = {k: torch.randn(max(args.rows), k).to(torch.bfloat16) for k in (HIDDEN, FFN)}
    nbytes = {fmt: sum(w.nbytes for w in ws) for fmt, ws in weights.items()}
    bandwidth = read_bandwidth_gbs(1024)
    lines = [f"one decode step's linears, ~1B Llama ({args.layers} layers + tied lm_head), bf16 activations, "
             f"{torch.get_num_threads()} threads, int8/int4 kernel: {simd_level()}",
             f"read bandwidth (same process, float32 sum over 1 GiB): {bandwidth:.1f} GB/s",
             f"{'format':<11} {'MB':>7} {'rows':>5} {'ms':>8} {'GB/s':>6} {'of bw':>6} {'vs bf16':>8}"]
    for rows in args.rows:
        best: dict[str, float] = {fmt: 1e9 for fmt in weights}
        for _ in range(args.rounds):  # formats in turn within each round: load changes hit them alike
            for fmt, ws in weights.items():
                best[fmt] = min(best[fmt], step(fmt, ws, xs, rows))
        for fmt in weights:
            gbs = nbytes[fmt] / best[fmt] / 1e9
            lines.append(f"{fmt:<11} {nbytes[fmt] / 1e6:>7.0f} {rows:>5} {best[fmt] * 1e3:>8.1f} {gbs:>6.1f} "
                         f"{gbs / bandwidth:>6.0%} {best['bf16'] / best[fmt]:>7.2f}x")
    text = "\n".join(lines)
    print(text)
    if args.save:
        Path(args.save).write_text(text + "\n")


if __name__ == "__main__":
    main()
