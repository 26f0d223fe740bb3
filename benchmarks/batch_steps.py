"""A batch workload's steps, one by one, against what each step must at least cost.

Why: `peers.py` gives a batch's wall time and `batch_profile.py` the share of each kind of work, but neither
says how far each step sits from its floor, so neither says where a faster batch could still come from. This
runs `peers.py`'s kvforge workload in-process, times every step and sorts it by what it ran:

- mixed steps (prefill chunks, with the running requests' decode rows riding along);
- decode-only steps, bucketed by their rows.

For each bucket it prints the steps, their time, the time per token, and two floors a step cannot beat:

- weights: the weight bytes one step reads (`decode_profile.bytes_read_per_token`) at the read bandwidth
  probed in this process before and after the run (best of 5 over 1 GiB each; the higher of the two, as this
  VM's bandwidth swings from minute to minute);
- FLOPs: the step's linear FLOPs (every layer linear for each token, less the last layer's linears after
  its K/V projections for the rows whose logits are not read, and the lm_head for each sampled row) at the
  rate the model's largest linear reaches on 1,024 rows in this process (its cache-friendly best).

In bf16 it also prints the CPU's VDPBF16PS peak on the same threads, on registers alone
(`csrc/bf16_peak.c`), and the run's linear FLOPs at that peak: the time no bf16 kernel on this CPU beats.

A step's floor is the larger of the two; attention and every other op are left out of it, so the floor is a
bound, not a target. `of floor` is floor / time: what the bucket reaches of it.

    PYTHONPATH=. python benchmarks/batch_steps.py --model-size 1b [--dtype bfloat16] [--workload batch] [--save FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers  # noqa: E402
from decode_profile import bytes_read_per_token, read_bandwidth_gbs  # noqa: E402

# decode-only steps by rows: (first, last) of each bucket; None: no upper end, so every step lands in one
ROW_BUCKETS = ((1, 4), (5, 8), (9, 12), (13, 16), (17, 24), (25, 32), (33, 64), (65, None))


@dataclass
class Step:
    prefill_tokens: int
    decode_rows: int
    sampled: int  # rows whose logits the step computed (lm_head rows)
    seconds: float


def linear_flops(model: torch.nn.Module) -> tuple[int, int, int]:
    """(FLOPs of every layer linear for one token, FLOPs of the lm_head for one row, FLOPs a row whose logits
    are not read skips: the last layer's linears but its K/V projections (Llama's fused q|k|v runs whole),
    where the model computes that layer on the read rows alone, `kvforge/models/output_rows.py`; else 0)."""
    from kvforge import envs

    head = getattr(model, "lm_head", None)

    def flops(mod: torch.nn.Module) -> int:
        return sum(2 * m.in_features * m.out_features for m in mod.modules()
                   if isinstance(m, torch.nn.Linear) and m is not head)

    skipped = 0
    if getattr(model, "takes_output_rows", False) and envs.KVFORGE_LAST_LAYER_ROWS:
        attn = model.model.layers[-1].self_attn
        kept = [getattr(attn, n) for n in ("qkv_proj", "k_proj", "v_proj") if hasattr(attn, n)]  # every row's K/V
        skipped = flops(model.model.layers[-1]) - sum(flops(m) for m in kept)
    return flops(model), (2 * head.in_features * head.out_features if head is not None else 0), skipped


def step_flops(s: "Step", flops: tuple[int, int, int]) -> int:
    """The linear FLOPs a step must run: every row through the layers, less what its unread rows skip, and
    the lm_head on the read rows."""
    layer, head, skipped = flops
    rows = s.prefill_tokens + s.decode_rows
    return rows * layer - (rows - s.sampled) * skipped + s.sampled * head


def gemm_rate(model: torch.nn.Module, rows: int = 1024, repeats: int = 3) -> float:
    """GFLOP/s of the model's largest layer linear on `rows` rows: the FLOP floor's rate. A panel-packed
    weight is timed into one preallocated output: the 1B preset's gate|up output is 32 MiB, which glibc
    maps afresh on every call, and its 8,192 page faults cost ~10% of the call on this VM; the engine's
    prefill never allocates it (its gate|up call writes silu(gate) * up, half the size)."""
    from kvforge.models.panel_linear import panel_linear

    head = getattr(model, "lm_head", None)
    big = max((m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head),
              key=lambda m: m.in_features * m.out_features)
    pw = getattr(big, "panel_weight", None) if getattr(big, "quant_weight", None) is None else None
    dtype = pw.dtype if pw is not None else next(big.parameters()).dtype
    x = torch.randn(rows, big.in_features).to(dtype)
    out = torch.empty(rows, big.out_features, dtype=dtype) if pw is not None else None

    def call() -> None:
        if pw is not None:
            panel_linear(x, pw, big.bias, out=out)
        else:
            big(x)

    best = float("inf")
    with torch.inference_mode():
        call()
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
    return 2 * rows * big.in_features * big.out_features / best / 1e9


def bf16_peak_gflops(threads: int, rounds: int = 5) -> float | None:
    """The CPU's VDPBF16PS rate on `threads` threads, on registers alone (csrc/bf16_peak.c says why); None
    where it cannot be measured (no compiler, or no AVX512-BF16)."""
    import ctypes
    from pathlib import Path

    from kvforge.native import NativeLibrary

    def declare(lib: ctypes.CDLL) -> None:
        lib.kvf_bf16_peak_gflops.restype = ctypes.c_double
        lib.kvf_bf16_peak_gflops.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]

    lib = NativeLibrary(Path(__file__).resolve().parent / "csrc" / "bf16_peak.c", None, "the bf16 peak probe",
                        declare).load()
    rate = lib.kvf_bf16_peak_gflops(threads, 20_000_000, rounds) if lib is not None else -1.0
    return rate if rate > 0 else None


def trace(llm, work: list[tuple[list[int], int]]) -> list[Step]:  # type: ignore[no-untyped-def]
    """Every step of `work` on this engine, as it ran."""
    from kvforge import SamplingParams

    engine = llm.engine
    steps: list[Step] = []
    execute = engine.runner.execute

    def timed(sched_out):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        ran = execute(sched_out)
        seconds = time.perf_counter() - t
        pre = dec = sampled = 0
        for c in sched_out.chunks:
            prompt = c.request.num_prompt_tokens
            if c.start < prompt:
                pre += c.num_tokens
                sampled += c.start + c.num_tokens >= prompt  # the chunk that ends a prompt samples
            else:
                dec += c.num_tokens
                sampled += c.num_tokens
        steps.append(Step(pre, dec, sampled, seconds))
        return ran

    engine.runner.execute = timed
    try:
        for prompt, out in work:
            engine.add_request(prompt_token_ids=prompt,
                               params=SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.runner.execute = execute
    return steps


def report(steps: list[Step], weight_bytes: int, bandwidth_gbs: float, flops: tuple[int, int, int],
           rate_gflops: float) -> str:
    def floor(s: Step) -> float:
        read = weight_bytes / (bandwidth_gbs * 1e9)
        return max(read, step_flops(s, flops) / (rate_gflops * 1e9))

    groups: list[tuple[str, list[Step]]] = [("mixed (prefill + decode rows)", [s for s in steps if s.prefill_tokens])]
    for lo, hi in ROW_BUCKETS:
        name = f"decode {lo}-{hi} rows" if hi else f"decode {lo}+ rows"
        groups.append((name, [s for s in steps if not s.prefill_tokens and lo <= s.decode_rows <= (hi or s.decode_rows)]))
    wall = sum(s.seconds for s in steps)
    lines = [f"{'steps':<30} {'n':>4} {'s':>7} {'share':>6} {'ms/step':>8} {'ms/token':>8} {'floor s':>8} "
             f"{'of floor':>8}"]
    for name, group in groups:
        if not group:
            continue
        sec = sum(s.seconds for s in group)
        tokens = sum(s.prefill_tokens + s.decode_rows for s in group)
        low = sum(floor(s) for s in group)
        lines.append(f"{name:<30} {len(group):>4} {sec:>7.2f} {sec / wall:>6.1%} {sec / len(group) * 1e3:>8.1f} "
                     f"{sec / tokens * 1e3:>8.2f} {low:>8.2f} {low / sec:>8.0%}")
    low = sum(floor(s) for s in steps)
    lines.append(f"{'all':<30} {len(steps):>4} {wall:>7.2f} {1:>6.0%} {wall / len(steps) * 1e3:>8.1f} "
                 f"{wall / sum(s.prefill_tokens + s.decode_rows for s in steps) * 1e3:>8.2f} {low:>8.2f} "
                 f"{low / wall:>8.0%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--kv", default="model", choices=sorted(peers.KVFORGE_KV))
    ap.add_argument("--workload", default="batch", choices=peers.WORKLOADS)
    ap.add_argument("--model-size", default=None, choices=["1b", "3b"],
                    help="a random-weight Llama of this size (benchmarks/random_llama.py); default: the default model")
    ap.add_argument("--model", default=None, help="a model folder (instead of --model-size or the default model)")
    ap.add_argument("--scale", type=float, default=1.0, help="the workload's size, as peers.py --scale")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="also write the output to this file")
    args = ap.parse_args()
    if args.model and args.model_size:
        ap.error("give --model or --model-size, not both")

    model = args.model
    if args.model_size:
        from random_llama import ensure_model

        model = ensure_model(args.model_size, log=lambda s: print(s, file=sys.stderr))
    llm = peers.kvforge_llm(args.dtype, args.kv, model)
    net = llm.engine.runner.model
    work = peers.requests(args.workload, args.seed, args.scale, llm.engine.model_config.vocab_size)
    peers.warm_up(llm, work)
    before = read_bandwidth_gbs(1024)
    steps = trace(llm, work)
    rate, after = gemm_rate(net), read_bandwidth_gbs(1024)
    peak = bf16_peak_gflops(torch.get_num_threads()) if args.dtype == "bfloat16" else None
    bandwidth = max(before, after)
    weights = bytes_read_per_token(net)
    head = (f"# {args.workload} {args.dtype} kv={args.kv} model={args.model_size or 'default'}: "
            f"{sum(o for _, o in work)} output tokens; budget {peers.BUDGET}\n"
            f"# floors: {weights / 1e9:.3f} GB of weights a step at {bandwidth:.1f} GB/s (probes before / after the "
            f"run: {before:.1f} / {after:.1f}); "
            f"linear FLOPs at {rate:.0f} GFLOP/s (the largest layer linear on 1,024 rows)")
    flops = linear_flops(net)
    text = head + "\n" + report(steps, weights, bandwidth, flops, rate)
    if peak:
        need = sum(step_flops(s, flops) for s in steps)
        text += (f"\n# the CPU's VDPBF16PS peak on {torch.get_num_threads()} threads (registers only): {peak:.0f} "
                 f"GFLOP/s; this run's linear FLOPs ({need / 1e12:.2f} TFLOP) take {need / peak / 1e9:.2f} s at it, "
                 f"{need / rate / 1e9:.2f} s at the kernel's 1,024-row rate")
    peers.emit(text, args.save)


if __name__ == "__main__":
    main()
