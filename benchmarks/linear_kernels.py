"""fp32 linear layers on this CPU: torch's default BLAS (`F.linear`) vs oneDNN (`kvforge.models.linear`),
then kvforge's panel kernel (`kvforge.models.panel_linear`, `KVFORGE_LINEAR=panel`) vs oneDNN's packed layouts.

The default model's shapes (SmolLM2-135M: hidden 576, packed qkv 960, packed
gate/up 3072, down from 1536, vocab 49152). Each layer shape cycles through 30
weight copies, as a 30-layer model does, so weights come from memory and not
from cache; rows M = decode batch size (or prefill tokens).

The second table (`--panel`) runs each shape at M in 1..1024 rows for each
thread count asked: the panel kernel, oneDNN on weights packed for 32 rows
(what `Linear.pack` uses) and for 1 row. The three are timed in turn, three
rounds, best of each kept (other processes share the cores); GB/s is weight
bytes / time, the decode bound being the machine's read bandwidth.

    python benchmarks/linear_kernels.py
    python benchmarks/linear_kernels.py --panel --threads 1 2 [--save FILE]   # results/2026-11-29_linear_kernels.txt, 2nd table
    python benchmarks/linear_kernels.py --panel --dtype bfloat16   # the bf16 panel kernel vs oneDNN bf16
    python benchmarks/linear_kernels.py --bf16-gemm --threads 2    # its GEMM tiles: vdpbf16ps vs fp32 FMAs

`--decode` measures what it buys end to end: the default model (fp32, one
stream, 128-token prompt) loaded twice, with KVFORGE_LINEAR=onednn and =panel,
decode steps timed in turn (best of `--rounds`), per thread count.

    python benchmarks/linear_kernels.py --decode --threads 1 2

`--step` times what a batch's decode step asks of the panel kernel (fp32, or bf16 with `--dtype`): every
layer linear of the default model's 30 layers (distinct weights, 425 MB in fp32, so they stream from DRAM)
plus lm_head (113 MB),
at 1 to 128 rows, against the two floors: the weights at the machine's read bandwidth (measured here)
and the FLOPs at the best rate the same calls reach with the weights in cache. Build variants are
compared by running it once per `KVFORGE_EXTRA_CFLAGS` (e.g. `-DKVF_GEMM_PREFETCH_EVEN=0`).

    python benchmarks/linear_kernels.py --step [--dtype bfloat16] [--save FILE]
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.models.linear import ONEDNN_LINEAR, linear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_call_ms(fn, x: torch.Tensor, weights: list[torch.Tensor], reps: int = 3) -> float:
    for w in weights:
        fn(x, w)
    start = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            fn(x, w)
    return (time.perf_counter() - start) / (reps * len(weights)) * 1e3


def torch_vs_onednn() -> None:
    torch.manual_seed(0)
    print(f"{'shape':<9} {'M':>4} {'torch ms':>9} {'oneDNN ms':>10} {'speed-up':>9} {'max rel diff':>13}")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k) for _ in range(1 if name == "lm_head" else 30)]
        for m in (1, 8, 32, 256):
            x = torch.randn(m, k)
            ref, out = F.linear(x, weights[0]), linear(x, weights[0])
            rel = ((ref - out).abs().max() / ref.abs().max()).item()
            base, fast = per_call_ms(F.linear, x, weights), per_call_ms(linear, x, weights)
            print(f"{name:<9} {m:>4} {base:>9.3f} {fast:>10.3f} {base / fast:>8.2f}x {rel:>13.1e}")


PANEL_ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)


def best_us(fns: dict, items: int, rounds: int = 3, budget_s: float = 0.15) -> dict[str, float]:
    """Per-call microseconds of each `fns[name](i)` over i in range(items), interleaved, best of `rounds`."""
    reps = {}
    for name, fn in fns.items():  # warm up, and size each timed block to ~budget_s
        start = time.perf_counter()
        for i in range(items):
            fn(i)
        reps[name] = max(1, round(budget_s / max(time.perf_counter() - start, 1e-9)))
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                for i in range(items):
                    fn(i)
            best[name] = min(best[name], (time.perf_counter() - start) / (reps[name] * items) * 1e6)
    return best


def panel_vs_onednn(threads: list[int], dtype: torch.dtype = torch.float32) -> None:
    from kvforge.models import panel_linear as pl

    if not pl.available(dtype):
        raise SystemExit(f"panel kernel unavailable: {pl.unavailable_reason(dtype)}")
    rows = PANEL_ROWS
    print(f"{dtype}: panel kernel SIMD path {'built' if pl.simd(dtype) else 'NOT built (plain C)'}")
    op, reorder = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    torch.manual_seed(0)
    losses: dict[tuple[int, str], list[int]] = {}
    for t in threads:
        torch.set_num_threads(t)
        print(f"\n{t} thread(s): per call us (GB/s of weights); speed-up = best oneDNN / panel")
        print(f"{'shape':<9} {'M':>5} {'panel':>17} {'oneDNN hint32':>17} {'oneDNN hint1':>17} {'speed-up':>9} "
              f"{'max rel diff':>13}")
        for name, (n, k) in SHAPES.items():
            dense = [torch.randn(n, k).to(dtype) for _ in range(1 if name == "lm_head" else 30)]
            panels = [pl.pack_panels(w) for w in dense]
            hint32, hint1 = [reorder(w, 32) for w in dense], [reorder(w, 1) for w in dense]
            gb = n * k * dense[0].element_size() / 1e3  # weight bytes / 1e3: GB/s when divided by microseconds
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                ref = F.linear(x.double(), dense[0].double())
                rel = ((pl.panel_linear(x, panels[0]).double() - ref).abs().max() / ref.abs().max()).item()
                us = best_us({
                    "panel": lambda i: pl.panel_linear(x, panels[i]),
                    "hint32": lambda i: op(x, hint32[i], None, "none", [], ""),
                    "hint1": lambda i: op(x, hint1[i], None, "none", [], ""),
                }, len(dense), rounds=3 if m <= 64 else 2)
                speed = min(us["hint32"], us["hint1"]) / us["panel"]
                if speed < 1:
                    losses.setdefault((t, name), []).append(m)
                cells = " ".join(f"{us[c]:>9.1f} ({gb / us[c]:>4.1f})" for c in ("panel", "hint32", "hint1"))
                print(f"{name:<9} {m:>5} {cells} {speed:>8.2f}x {rel:>13.1e}", flush=True)
    print("\nrow counts M where oneDNN (either packing) beat the panel kernel:")
    for t in threads:
        print(f"  {t} thread(s): " + "; ".join(f"{name} {losses.get((t, name)) or 'none'}" for name in SHAPES))


def bf16_gemm_tiles(threads: list[int]) -> None:
    """The bf16 panel kernel's GEMM tiles (vdpbf16ps, bf16 widened to fp32 FMAs, and AMX tiles where the
    CPU has them) on the model's shapes at 8-1024 rows, interleaved, with the tile this CPU's load-time
    choice picks."""
    from kvforge.models import panel_linear as pl

    lib = pl.LIBRARY_BF16.load()
    if lib is None or not lib.kvf_panel_bf16_simd():
        raise SystemExit("the bf16 panel kernel's AVX512-BF16 path is not built here: no GEMM tiles to compare")
    auto = pl.bf16_gemm_mode()
    modes = ["dot", "fma"] + (["amx"] if lib.kvf_panel_bf16_amx() else [])
    print(f"bf16 GEMM tiles; this CPU's choice (KVFORGE_BF16_GEMM=auto): {auto}"
          + ("" if "amx" in modes else " (no AMX tiles here)"))
    torch.manual_seed(0)
    for t in threads:
        torch.set_num_threads(t)
        print(f"\n{t} thread(s): per call us (GFLOP/s); speed-up = dot / each; max rel diff against dot")
        print(f"{'shape':<9} {'M':>5} " + " ".join(f"{m:>19}" for m in modes)
              + " " + " ".join(f"{'dot/' + m:>9}" for m in modes[1:]) + f" {'max rel diff':>13}")
        for name, (n, k) in SHAPES.items():
            dense = [torch.randn(n, k).bfloat16() for _ in range(1 if name == "lm_head" else 4)]
            panels = [pl.pack_panels(w) for w in dense]
            for m in (8, 32, 64, 256, 1024):
                x = torch.randn(m, k).bfloat16()
                outs = {}
                for mode in modes:
                    lib.kvf_panel_bf16_set_gemm_mode(pl.BF16_GEMM_MODES[mode])
                    outs[mode] = pl.panel_linear(x, panels[0]).float()
                # each rounds one fp32 sum to bf16; the sums differ in order: relative to the largest output
                diff = max(((outs["dot"] - outs[m]).abs().max() / outs["dot"].abs().max()).item() for m in modes)

                def run(mode: str):
                    def call(i: int) -> None:
                        lib.kvf_panel_bf16_set_gemm_mode(pl.BF16_GEMM_MODES[mode])
                        pl.panel_linear(x, panels[i])
                    return call

                us = best_us({mode: run(mode) for mode in modes}, len(dense), rounds=3 if m <= 64 else 2)
                flop = 2 * m * n * k / 1e3  # / us -> GFLOP/s
                cells = " ".join(f"{us[c]:>9.1f} ({flop / us[c]:>7.1f})" for c in modes)
                ups = " ".join(f"{us['dot'] / us[c]:>8.2f}x" for c in modes[1:])
                print(f"{name:<9} {m:>5} {cells} {ups} {diff:>13.1e}", flush=True)
    lib.kvf_panel_bf16_set_gemm_mode(pl.BF16_GEMM_MODES[auto])


def decode_onednn_vs_panel(threads: list[int], tokens: int = 64, rounds: int = 3) -> None:
    from decode_profile import decode_steps  # benchmarks/ is on sys.path when run as a script

    from kvforge import LLM

    llms = {}
    for backend in ("onednn", "panel"):
        os.environ["KVFORGE_LINEAR"] = backend  # read when the engine packs the weights at load
        llms[backend] = LLM(model=None, dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", log_ledger=False)
    vocab = llms["panel"].engine.model_config.vocab_size
    prompt = [(i * 7919) % vocab for i in range(128)]
    print("single-stream fp32 decode, default model: ms per decode step (best of rounds, interleaved)")
    for t in threads:
        torch.set_num_threads(t)
        best = {b: float("inf") for b in llms}
        for llm in llms.values():
            decode_steps(llm, prompt[:16], 4)  # warm-up
        for _ in range(rounds):
            for backend, llm in llms.items():
                seconds, steps = decode_steps(llm, prompt, tokens)
                best[backend] = min(best[backend], seconds / steps * 1e3)
        print(f"  {t} thread(s): oneDNN {best['onednn']:.2f} ms, panel {best['panel']:.2f} ms, "
              f"speed-up {best['onednn'] / best['panel']:.2f}x", flush=True)


STEP_ROWS = (1, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 128, 1024)


def read_bandwidth_gbs(mib: int = 1024) -> float:
    """Best of 3 sums of a buffer far larger than the caches: the machine's DRAM read rate."""
    buf = torch.ones(mib * 1024 * 1024 // 4)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def min_seconds(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    """Best of `rounds` timed calls, after one untimed call (kernel build, first touch)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def decode_step_linears(threads: list[int], dtype: torch.dtype = torch.float32, rounds: int = 3) -> None:
    from kvforge.models import panel_linear as pl

    if not pl.available(dtype):
        raise SystemExit(f"panel kernel unavailable: {pl.unavailable_reason(dtype)}")
    torch.manual_seed(0)
    layer = [SHAPES[n] for n in ("qkv", "o_proj", "gate_up", "down")]
    weights = [[pl.pack_panels(torch.randn(n, k).to(dtype)) for n, k in layer] for _ in range(30)]
    head = pl.pack_panels(torch.randn(*SHAPES["lm_head"]).to(dtype))
    nbytes = sum(w.nbytes for ws in weights for w in ws) + head.nbytes
    params = sum(n * k for n, k in layer) * 30 + SHAPES["lm_head"][0] * SHAPES["lm_head"][1]
    extra = os.environ.get("KVFORGE_EXTRA_CFLAGS", "")
    print(f"{dtype} panel kernel, one decode step's linears: 30 layers x (qkv, o_proj, gate_up, down) + lm_head, "
          f"{nbytes / 1e6:.0f} MB of weights; KVFORGE_EXTRA_CFLAGS={extra!r}")
    for t in threads:
        torch.set_num_threads(t)
        bw = read_bandwidth_gbs()
        print(f"\n{t} thread(s): read bandwidth {bw:.1f} GB/s -> memory floor {nbytes / bw / 1e6:.1f} ms a step; "
              "floor = max(memory floor, FLOPs at the cached rate)")
        print(f"{'rows':>5} {'step ms':>8} {'GB/s':>6} {'GFLOP/s':>8} {'cached GFLOP/s':>15} {'floor ms':>9} {'x floor':>8}")
        for m in STEP_ROWS:
            xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}

            def step(layers: list) -> None:  # noqa: ANN001
                for ws in layers:
                    for w in ws:
                        pl.panel_linear(xs[w.k], w)

            # the step out of DRAM; then the same calls on one layer's weights, in cache: the rate these rows reach
            best = min_seconds(lambda: (step(weights), pl.panel_linear(xs[576], head)), rounds)
            hot = min_seconds(lambda: step(weights[:1] * 30), rounds)
            hot_rate = 2 * m * sum(n * k for n, k in layer) * 30 / hot / 1e9
            flops = 2 * m * params
            floor = max(nbytes / (bw * 1e9), flops / (hot_rate * 1e9)) * 1e3
            print(f"{m:>5} {best * 1e3:>8.2f} {nbytes / best / 1e9:>6.1f} {flops / best / 1e9:>8.0f} "
                  f"{hot_rate:>15.0f} {floor:>9.1f} {best * 1e3 / floor:>7.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--panel", action="store_true", help="panel kernel vs oneDNN packed (instead of torch vs oneDNN)")
    parser.add_argument("--decode", action="store_true", help="end to end: default model decode, oneDNN vs panel")
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="--panel, --step: weight dtype (bfloat16: the AVX512-BF16 kernel)")
    parser.add_argument("--bf16-gemm", action="store_true",
                        help="the bf16 panel kernel's GEMM tiles: vdpbf16ps vs fp32 FMAs vs AMX (KVFORGE_BF16_GEMM)")
    parser.add_argument("--step", action="store_true",
                        help="one decode step's linears out of DRAM at 1-128 rows, against its floors (--dtype)")
    parser.add_argument("--save", type=Path, help="also write the output to this file")
    args = parser.parse_args()
    if not ONEDNN_LINEAR:
        raise SystemExit("oneDNN linear is unavailable here (or KVFORGE_ONEDNN_LINEAR=0): nothing to compare")
    out = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, s: str) -> int:
            print(s, end="", file=sys.__stdout__, flush=True)
            return out.write(s)

    with redirect_stdout(Tee()):
        if args.step:
            decode_step_linears(args.threads, getattr(torch, args.dtype))
        elif args.bf16_gemm:
            bf16_gemm_tiles(args.threads)
        elif args.decode:
            decode_onednn_vs_panel(args.threads)
        elif args.panel:
            panel_vs_onednn(args.threads, getattr(torch, args.dtype))
        else:
            torch_vs_onednn()
    if args.save:
        args.save.write_text(out.getvalue())


if __name__ == "__main__":
    main()
