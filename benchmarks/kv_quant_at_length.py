"""KV-quantization error against context length (issue 45): `kvforge eval kv-quant` at long contexts, row by row.

The same measurement as `kvforge eval kv-quant --contexts 2048,8192 --formats ...` (one engine, the
library's `KVQuantEval`), but each row is appended to a JSONL file the moment it is measured, so a
long run on a shared machine keeps what it finished. The table and the curve are rendered from
that file at the end (or with --render alone).

  python benchmarks/kv_quant_at_length.py --contexts 2048,8192 --save benchmarks/results/DATE_kv_quant_at_length
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

FORMATS = ("fp8_e4m3,fp8_e4m3@head,fp8_e5m2@head,int8,int8@head,int4@head,int4@channel,"
           "bfloat16/int8,bfloat16/fp8_e4m3@head,int8/int4@head")


def _row(d: dict):  # type: ignore[no-untyped-def]
    from kvforge.evaluation.kv_quant import RowResult

    d = dict(d)
    d["perplexity"] = {int(k): v for k, v in d["perplexity"].items()}
    return RowResult(**d)


def render(prefix: str) -> str:
    from kvforge.evaluation.kv_quant import EvalOptions
    from kvforge.evaluation.kv_quant_report import render_table, save_plot

    with open(prefix + ".jsonl") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    meta, rows = lines[0], [_row(d) for d in lines[1:]]
    opts = EvalOptions(**{**meta["options"], "contexts": tuple(meta["options"]["contexts"])})
    table = render_table(rows, opts, meta["model"])
    depth = ["", "depth profile: perplexity of each quarter of the longest window (+% vs the reference's quarter)"]
    for r in rows:
        cells = [f"{p:.3f}" if r is rows[0] else f"{p:.3f} ({100 * (p / q - 1):+.2f}%)"
                 for p, q in zip(r.depth, rows[0].depth)]
        depth.append(f"  {r.spec:<24} " + "  ".join(cells))
    text = "\n".join([table, *depth, "", f"command: {meta['command']}", f"machine: {meta['machine']}",
                      f"wall time: {meta.get('seconds', '?')} s per row (shared, loaded 2-core machine)"])
    with open(prefix + ".txt", "w") as f:
        f.write(text + "\n")
    try:
        save_plot(rows, prefix + ".png")
    except ValueError as exc:  # matplotlib missing: the table is the result, the plot optional
        print(exc, file=sys.stderr)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--formats", default=FORMATS)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--save", default=f"benchmarks/results/{datetime.date.today()}_kv_quant_at_length")
    p.add_argument("--render", action="store_true", help="only render the .txt/.png from an existing .jsonl")
    args = p.parse_args()
    if args.render:
        print(render(args.save))
        return 0
    from kvforge.commands.eval import _engine_for_eval
    from kvforge.evaluation.kv_quant import EvalOptions, KVQuantEval, Variant, measured_variants

    opts = EvalOptions(contexts=tuple(int(c) for c in args.contexts.split(",")), num_prompts=args.num_prompts,
                       gen_tokens=args.gen_tokens, prefill_chunk=args.prefill_chunk)
    ns = argparse.Namespace(model=args.model, dtype="float32", device="cpu", block_size=16)
    engine = _engine_for_eval(ns, opts)
    ev = KVQuantEval(engine, opts)
    meta = {"model": args.model or "SmolLM2-135M-Instruct (default), fp32", "options": {**vars(opts),
            "contexts": list(opts.contexts)}, "command": "python " + " ".join(sys.argv),
            "machine": f"{os.cpu_count()} CPUs, shared by other jobs (load {os.getloadavg()[0]:.1f})"}
    times = []
    with open(args.save + ".jsonl", "w") as f:
        f.write(json.dumps(meta) + "\n")
        for v in measured_variants([Variant.parse(s) for s in args.formats.split(",") if s.strip()]):
            t0 = time.perf_counter()
            row = ev.run_variant(v)
            times.append(time.perf_counter() - t0)
            f.write(json.dumps(row.to_dict()) + "\n")
            f.flush()
            print(f"{v.spec}: " + ", ".join(f"ppl@{c} {p:.4f}" for c, p in row.perplexity.items())
                  + f" ({times[-1]:.0f} s)", flush=True)
    meta["seconds"] = round(sum(times) / len(times))
    with open(args.save + ".jsonl") as f:
        rest = f.read().splitlines()[1:]
    with open(args.save + ".jsonl", "w") as f:
        f.write("\n".join([json.dumps(meta), *rest]) + "\n")
    print(render(args.save))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
