"""What the KV block size costs or saves on CPU: the decode kernel per block size, and a workload end to end.

kvforge's blocks hold 16 tokens (`block_size`, `--block-size`), as vLLM's do on GPUs; vLLM's CPU backend
picks 128 when the user does not say. A block is one contiguous stretch of the pool (`[blocks, block_size,
kv_heads, head_dim]`), so a decode step reads a sequence's KV in runs as long as its consecutive blocks are
also consecutive in the pool: one block where the pool is fragmented, many where the allocator handed them out
in order. Longer runs let the hardware prefetcher stream; shorter blocks share
prefixes more finely (a cache hit covers whole blocks only), waste fewer slots at each sequence's end, and are
the unit of block-level eviction and of per-block KV scales. This measures the speed side:

- `kernel` (default): the CPU decode kernel over `--layers` layers' caches of one shape, each block size's
  pool once shuffled (a long-running server's worst case) and once with every sequence's blocks in order (a
  fresh pool's prompts), the calls alternating in one process (ms per layer and the KV read rate);
- `--tables`: how often, step by step through a workload, a sequence's next block is also the pool's next
  block in the engine's own tables (which kernel column the engine is nearer);
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
from random_llama import PRESETS, ensure_model  # noqa: E402

SIZES = (16, 32, 64, 128)


def kernel(args: argparse.Namespace) -> str:
    """Decode attention per layer at each block size, on a shuffled pool and on one whose tables run in order,
    calls alternating, as a text table."""
    from kvforge.attention.cpu_paged import paged_attention_cpu
    from quantized_decode import build

    kv_heads, heads = args.heads
    dtype = getattr(torch, args.dtype)

    def layers(bs: int, in_order: bool) -> list:
        built = [build(args.dtype, "token", dtype, args.batch, args.len, bs=bs, seed=i, kv_heads=kv_heads,
                       heads=heads) for i in range(args.layers)]
        if in_order:  # each sequence's blocks one after the other in the pool (block 0 is the pool's null block)
            for _, _, meta in built:
                nb = args.len // bs
                meta.decode_block_tables.copy_(torch.arange(1, args.batch * nb + 1).view(args.batch, nb))
        return built

    pools = {(bs, in_order): layers(bs, in_order) for bs in args.sizes for in_order in (False, True)}
    times: dict[tuple[int, bool], list[float]] = {key: [] for key in pools}
    for _ in range(args.repeats + 1):
        for key, caches in pools.items():
            start = time.perf_counter()
            for q, cache, meta in caches:
                paged_attention_cpu(q, cache, meta, 0.125)
            times[key].append((time.perf_counter() - start) / len(caches))
    best = {key: min(t[1:]) for key, t in times.items()}  # the first call warms up
    kv_bytes = args.batch * args.len * kv_heads * 64 * 2 * dtype.itemsize
    base = best[(args.sizes[0], False)]
    lines = [f"# decode attention, {args.batch} sequences x {args.len} tokens, {kv_heads} KV / {heads} query heads "
             f"of 64, {args.dtype}, {args.layers} layers' caches a call, {args.repeats} alternating calls each, "
             f"{torch.get_num_threads()} threads; min ms per layer, KV GB/s, and against {args.sizes[0]} shuffled",
             f"{'block':>6} {'shuffled ms':>12} {'GB/s':>6} {'vs base':>8} {'in order ms':>12} {'GB/s':>6} {'vs base':>8}"]
    for bs in args.sizes:
        cols = []
        for in_order in (False, True):
            t = best[(bs, in_order)]
            cols.append(f"{t * 1e3:>12.3f} {kv_bytes / t / 1e9:>6.1f} {base / t:>7.2f}x")
        lines.append(f"{bs:>6} " + " ".join(cols))
    return "\n".join(lines)


CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import peers
work = peers.requests({workload!r}, 0, {scale!r}, {vocab!r})
print(json.dumps(peers.run_kvforge({dtype!r}, "model", work, warm=True, model={model!r}, block_size={bs})))
"""


def model_folder(args: argparse.Namespace) -> str | None:
    """`--model`, or the `--model-size` preset's folder (built once), or None: the default model."""
    if args.model_size:
        return ensure_model(args.model_size, log=lambda s: print(s, file=sys.stderr))
    return args.model


def engine(args: argparse.Namespace) -> str:
    """The workload once per (round, block size) in its own process, sizes alternating; medians per size."""
    model = model_folder(args)
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


def tables(args: argparse.Namespace) -> str:
    """How often a sequence's next block is the pool's next block, in the engine's own tables, step by step
    through a workload (in this process): what the kernel's `in order` and `shuffled` columns stand for."""
    from kvforge import SamplingParams

    model = model_folder(args)
    llm = peers.kvforge_llm(args.dtype, "model", model, block_size=args.sizes[0])
    peers.warm_up(llm, [([5], 1)])
    engine = llm.engine
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
           for p, o in peers.requests(args.workload, 0, args.scale, args.vocab)]
    lines = [f"# {args.workload} through the engine on {args.sizes[0]}-token blocks (model "
             f"{args.model_size or model or 'default'}, scale {args.scale}): running sequences' block pairs whose "
             f"second block follows the first in the pool",
             f"{'step':>6} {'sequences':>10} {'pairs':>7} {'in order':>9}"]
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step % args.every:
            continue
        pairs = adjacent = seqs = 0
        for rid in ids:
            blocks = engine.kv.block_ids(rid)[0]  # empty once finished: its blocks are back in the pool
            if not blocks:
                continue
            seqs += 1
            pairs += len(blocks) - 1
            adjacent += sum(b == a + 1 for a, b in zip(blocks, blocks[1:]))
        if pairs > 0:
            lines.append(f"{step:>6} {seqs:>10} {pairs:>7} {adjacent / pairs:>8.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="block sizes; the first is the base")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--engine", action="store_true", help="a peers.py workload through the engine instead")
    ap.add_argument("--tables", action="store_true",
                    help="how often the engine's tables run in order through a workload (the first --sizes only)")
    ap.add_argument("--every", type=int, default=20, help="tables: print every this many steps")
    ap.add_argument("--heads", type=int, nargs=2, default=[3, 9], metavar=("KV", "Q"),
                    help="kernel: KV and query heads of 64 (the default model's; the 1B preset: 8 32)")
    ap.add_argument("--batch", type=int, default=32, help="kernel: sequences")
    ap.add_argument("--len", type=int, default=384, help="kernel: tokens each (a multiple of every size)")
    ap.add_argument("--layers", type=int, default=16, help="kernel: caches walked per call (out of DRAM, as a step)")
    ap.add_argument("--repeats", type=int, default=11, help="kernel: timed calls per size")
    ap.add_argument("--workload", default="batch", choices=peers.WORKLOADS, help="engine, tables: a peers.py workload")
    ap.add_argument("--model", default=None, help="engine, tables: a model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--model-size", default=None, choices=sorted(PRESETS),
                    help="engine, tables: a random_llama.py preset instead")
    ap.add_argument("--scale", type=float, default=1.0, help="engine, tables: shrink the workload (quick runs)")
    ap.add_argument("--rounds", type=int, default=2, help="engine: rounds over the sizes")
    ap.add_argument("--vocab", type=int, default=peers.VOCAB, help="engine, tables: prompt ids are drawn below this")
    ap.add_argument("--save", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if any(bs < 1 for bs in args.sizes):
        ap.error(f"--sizes must be positive, got {args.sizes}")
    if args.engine and args.tables:
        ap.error("--engine and --tables: give one")
    for name in ("every", "rounds", "repeats", "layers", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be positive, got {getattr(args, name)}")
    if not (args.engine or args.tables) and any(args.len % bs for bs in args.sizes):
        ap.error(f"--len ({args.len}) must be a multiple of every block size {args.sizes}")
    if args.model and args.model_size:
        ap.error("--model and --model-size: give one")
    text = tables(args) if args.tables else engine(args) if args.engine else kernel(args)
    print(text)
    if args.save:
        with open(args.save, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
