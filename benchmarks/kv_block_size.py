"""What the KV block size costs or saves on CPU: the decode kernel per block size, and a workload end to end.

kvforge's blocks hold 16 tokens (`block_size`, `--block-size`), as vLLM's do on GPUs; vLLM's CPU backend
picks 128 when the user does not say. A block is one contiguous stretch of the pool (`[blocks, block_size,
kv_heads, head_dim]`), and a sequence's blocks lie wherever the allocator found them, so a decode step reads
its KV as runs of one block each. Longer runs let the hardware prefetcher stream; shorter blocks share
prefixes more finely (a cache hit covers whole blocks only), waste fewer slots at each sequence's end, and are
the unit of block-level eviction and of per-block KV scales. This measures the speed side:

- `kernel` (default): the CPU decode kernel over `--layers` layers' caches of one shape, each block size's
  pool shuffled as a long-running server's is, the sizes' calls alternating in one process (ms per layer and
  the KV read rate);
- `--engine`: `peers.py`'s workload through the whole engine, one process per (block size, round), the sizes
  alternating round by round (wall, output tok/s, decode-phase tok/s, mean TTFT).

    python benchmarks/kv_block_size.py --heads 8 32 --batch 32 --len 384            # the 1B preset's shape
    python benchmarks/kv_block_size.py --engine --model-size 1b --workload batch --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peers  # noqa: E402

SIZES = (16, 32, 64, 128)


def kernel(args: argparse.Namespace) -> str:
    """Decode attention per layer at each block size, calls alternating, as a text table."""
    from kvforge.attention.cpu_paged import paged_attention_cpu
    from quantized_decode import build

    kv_heads, heads = args.heads
    dtype = getattr(torch, args.dtype)
    pools = {bs: [build(args.dtype, "token", dtype, args.batch, args.len, bs=bs, seed=i, kv_heads=kv_heads,
                        heads=heads) for i in range(args.layers)]
             for bs in args.sizes}
    times: dict[int, list[float]] = {bs: [] for bs in args.sizes}
    outs: dict[int, torch.Tensor] = {}
    for _ in range(args.repeats + 1):
        for bs, layers in pools.items():
            start = time.perf_counter()
            for q, cache, meta in layers:
                outs[bs] = paged_attention_cpu(q, cache, meta, 0.125)
            times[bs].append((time.perf_counter() - start) / len(layers))
    kv_bytes = args.batch * args.len * kv_heads * 64 * 2 * dtype.itemsize
    base = min(times[args.sizes[0]][1:])
    lines = [f"# decode attention, {args.batch} sequences x {args.len} tokens, {kv_heads} KV / {heads} query heads "
             f"of 64, {args.dtype}, {args.layers} layers' caches a call, {args.repeats} alternating calls each, "
             f"{torch.get_num_threads()} threads",
             f"{'block':>6} {'min ms':>8} {'med ms':>8} {'GB/s':>6} {'vs ' + str(args.sizes[0]):>7}"]
    for bs in args.sizes:
        t = sorted(times[bs][1:])  # the first call warms up
        lines.append(f"{bs:>6} {t[0] * 1e3:>8.3f} {statistics.median(t) * 1e3:>8.3f} {kv_bytes / t[0] / 1e9:>6.1f} "
                     f"{base / t[0]:>6.2f}x")
    return "\n".join(lines)


CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import peers
work = peers.requests({workload!r}, 0, {scale!r}, {vocab!r})
print(json.dumps(peers.run_kvforge({dtype!r}, "model", work, warm=True, model={model!r}, block_size={bs})))
"""


def engine(args: argparse.Namespace) -> str:
    """The workload once per (round, block size) in its own process, sizes alternating; medians per size."""
    model = args.model
    if args.model_size:
        from random_llama import ensure_model

        model = ensure_model(args.model_size, log=lambda s: print(s, file=sys.stderr))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    runs: dict[int, list[dict]] = {bs: [] for bs in args.sizes}
    for r in range(args.rounds):
        for bs in args.sizes:
            code = CHILD.format(here=HERE, bs=bs, workload=args.workload, scale=args.scale, vocab=args.vocab,
                                dtype=args.dtype, model=model)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
            if proc.returncode:
                raise SystemExit(f"block size {bs}: the run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[bs].append(row)
            print(f"round {r + 1}/{args.rounds}, block {bs}: {row['wall_s']:.2f} s, {row['out_tok_s']:.1f} out tok/s",
                  file=sys.stderr, flush=True)
    med = {bs: {k: statistics.median(x[k] for x in rows) for k in ("wall_s", "out_tok_s", "decode_tok_s",
                                                                     "mean_ttft_ms")}
           for bs, rows in runs.items()}
    base = med[args.sizes[0]]["out_tok_s"]
    lines = [f"# {args.workload} ({args.dtype}, KV in the model dtype, model {args.model_size or model or 'default'}, "
             f"scale {args.scale}), medians of {args.rounds} rounds, one process a run, block sizes alternating",
             f"{'block':>6} {'wall s':>8} {'out tok/s':>10} {'decode tok/s':>13} {'mean TTFT s':>12} "
             f"{'vs ' + str(args.sizes[0]):>7}  rounds (out tok/s)"]
    for bs, m in med.items():
        spread = ", ".join(f"{x['out_tok_s']:.1f}" for x in runs[bs])
        lines.append(f"{bs:>6} {m['wall_s']:>8.2f} {m['out_tok_s']:>10.1f} {m['decode_tok_s']:>13.1f} "
                     f"{m['mean_ttft_ms'] / 1e3:>12.2f} {m['out_tok_s'] / base:>6.3f}x  {spread}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="block sizes; the first is the base")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--engine", action="store_true", help="a peers.py workload through the engine instead")
    ap.add_argument("--heads", type=int, nargs=2, default=[3, 9], metavar=("KV", "Q"),
                    help="kernel: KV and query heads of 64 (the default model's; the 1B preset: 8 32)")
    ap.add_argument("--batch", type=int, default=32, help="kernel: sequences")
    ap.add_argument("--len", type=int, default=384, help="kernel: tokens each (a multiple of every size)")
    ap.add_argument("--layers", type=int, default=16, help="kernel: caches walked per call (out of DRAM, as a step)")
    ap.add_argument("--repeats", type=int, default=11, help="kernel: timed calls per size")
    ap.add_argument("--workload", default="batch", choices=peers.WORKLOADS, help="engine: a peers.py workload")
    ap.add_argument("--model", default=None, help="engine: a model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--model-size", default=None, help="engine: a random_llama.py preset (e.g. 1b) instead")
    ap.add_argument("--scale", type=float, default=1.0, help="engine: shrink the workload (quick runs)")
    ap.add_argument("--rounds", type=int, default=2, help="engine: rounds over the sizes")
    ap.add_argument("--vocab", type=int, default=peers.VOCAB, help="engine: prompt ids are drawn below this")
    ap.add_argument("--save", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if any(bs < 1 for bs in args.sizes):
        ap.error(f"--sizes must be positive, got {args.sizes}")
    if not args.engine and any(args.len % bs for bs in args.sizes):
        ap.error(f"--len ({args.len}) must be a multiple of every block size {args.sizes}")
    if args.model and args.model_size:
        ap.error("--model and --model-size: give one")
    text = engine(args) if args.engine else kernel(args)
    print(text)
    if args.save:
        with open(args.save, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
