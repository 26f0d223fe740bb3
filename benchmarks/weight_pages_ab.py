"""Where a loaded model's weights sit in physical memory, and what that costs a decode step's linears.

Why: decode reads every weight byte each step, and loading leaves the weights on 4 KiB pages scattered
across physical memory (models/weight_pages.py). This builds kvforge's engine with
`KVFORGE_WEIGHT_PAGES=0` (the weights stay as loaded) and then times one decode step's linears in turn on:

- `loaded`: the engine's own weights;
- `fresh`: a copy of them on fresh 4 KiB pages (`MADV_NOHUGEPAGE`);
- `2m`: a copy on 2 MiB pages where the kernel gives them (`MADV_HUGEPAGE`).

The three run in rotating order, round after round, so a swing in this VM's bandwidth hits each of them
alike; each row prints the medians. Then `settle_weight_pages` moves the engine's own weights in place (what
a default load does), and the same rounds run again: `loaded` should now match `2m`.

Run as root, it also prints how scattered each layout is: the distinct 2 MiB physical frames that each
2 MiB of weights touches (1.0: contiguous; /proc/self/pagemap gives page frame numbers to root only).

    PYTHONPATH=. python benchmarks/weight_pages_ab.py --model-size 1b [--rows 1 8 16 32] [--rounds 9] [--save FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import struct
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers  # noqa: E402

HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15


def panel_weights(model: torch.nn.Module) -> list:
    """The panel layouts of every packed linear (and the panel-read embedding), in module order."""
    from kvforge.models.linear import Linear, PanelEmbedding

    return [m.panel_weight for m in model.modules()
            if isinstance(m, (Linear, PanelEmbedding)) and m.panel_weight is not None]


def copy_onto_pages(t: torch.Tensor, advice: int, keep: list) -> torch.Tensor:
    """`t` copied into a new 2 MiB-aligned buffer whose pages got `advice` before they were touched."""
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    off = (-buf.data_ptr()) % HUGE
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(buf.data_ptr() + off, nbytes // HUGE * HUGE, advice)
    out = buf[off:off + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    keep.append(buf)
    return out


def frames_per_2mib(tensors: list[torch.Tensor]) -> float | None:
    """Distinct 2 MiB physical frames per 2 MiB of `tensors` (1.0 at best), or None without page frame numbers."""
    frames, pages = 0, 0
    try:
        with open("/proc/self/pagemap", "rb") as f:
            for t in tensors:
                a, e = -(-t.data_ptr() // 4096), (t.data_ptr() + t.numel() * t.element_size()) // 4096
                f.seek(a * 8)
                pfns = [x & ((1 << 55) - 1) for x in struct.unpack(f"{e - a}Q", f.read((e - a) * 8))]
                if not any(pfns):
                    return None  # not root: the kernel hides the frame numbers
                frames += len({p >> 9 for p in pfns})
                pages += len(pfns)
    except OSError:
        return None
    return frames / (pages / 512) if pages else None


def step_seconds(weights: list, rows: int, xs: dict) -> float:
    """One decode step's linears: every weight once, on `rows` rows."""
    from kvforge.models.panel_linear import panel_linear

    t = time.perf_counter()
    for w in weights:
        panel_linear(xs[(rows, w.k)], w)
    return time.perf_counter() - t


def rounds_table(arms: dict[str, list], rows_list: list[int], rounds: int) -> list[str]:
    names = list(arms)
    xs = {(m, k): torch.randn(m, k).bfloat16() for m in rows_list for k in {w.k for w in arms[names[0]]}}
    lines = [f"{'rows':>5} " + " ".join(f"{n + ' ms':>10}" for n in names) + "  " +
             " ".join(f"{'loaded/' + n:>12}" for n in names[1:])]
    for m in rows_list:
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(step_seconds(arms[n], m, xs))
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        lines.append(f"{m:>5} " + " ".join(f"{med[n]:>10.1f}" for n in names) + "  " +
                     " ".join(f"{med['loaded'] / med[n]:>12.3f}" for n in names[1:]))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", default=None, choices=["1b", "3b"],
                    help="a random-weight Llama of this size (benchmarks/random_llama.py); default: the default model")
    ap.add_argument("--model", default=None, help="a model folder (instead of --model-size or the default model)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--save", default=None, help="also write the output to this file")
    args = ap.parse_args()
    if args.model and args.model_size:
        ap.error("give --model or --model-size, not both")
    if args.rounds < 1 or min(args.rows) < 1:
        ap.error("--rounds and --rows must be positive")
    model = args.model
    if args.model_size:
        from random_llama import ensure_model

        model = ensure_model(args.model_size, log=lambda s: print(s, file=sys.stderr))
    os.environ["KVFORGE_WEIGHT_PAGES"] = "0"  # the engine's weights stay where loading put them
    llm = peers.kvforge_llm("bfloat16", "model", model)
    from kvforge.models.weight_pages import settle_weight_pages

    loaded = panel_weights(llm.engine.runner.model)
    if not loaded:
        sys.exit("no panel-packed bf16 weights: this needs the AVX512-BF16 panel kernel")
    from kvforge.models.panel_linear import PanelWeight

    keep: list = []
    arms = {"loaded": loaded,
            "fresh": [PanelWeight(copy_onto_pages(w.packed, _MADV_NOHUGEPAGE, keep), w.n, w.k) for w in loaded],
            "2m": [PanelWeight(copy_onto_pages(w.packed, _MADV_HUGEPAGE, keep), w.n, w.k) for w in loaded]}
    total = sum(w.nbytes for w in loaded)
    out = [f"# {len(loaded)} panel weights, {total / 1e9:.2f} GB (model={args.model_size or args.model or 'default'}); "
           f"medians of {args.rounds} rounds, arms in rotating order"]
    scatter = {n: frames_per_2mib([w.packed for w in ws]) for n, ws in arms.items()}
    if all(v is not None for v in scatter.values()):
        out.append("# 2 MiB physical frames per 2 MiB of weights: " +
                   ", ".join(f"{n} {v:.1f}" for n, v in scatter.items()))
    out.append("## the engine's weights as loaded (KVFORGE_WEIGHT_PAGES=0)")
    out += rounds_table(arms, args.rows, args.rounds)
    report = settle_weight_pages(llm.engine.runner.model)
    out.append(f"## the engine's weights after settle_weight_pages: {report.describe()}")
    settled = frames_per_2mib([w.packed for w in loaded])
    if settled is not None:
        out.append(f"# 2 MiB physical frames per 2 MiB of weights, loaded after settling: {settled:.1f}")
    out += rounds_table(arms, args.rows, args.rounds)
    text = "\n".join(out)
    peers.emit(text, args.save)


if __name__ == "__main__":
    main()
