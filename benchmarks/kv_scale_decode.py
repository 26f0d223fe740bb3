"""One stream's decode speed per KV format and scale layout, end to end through the engine.

Why: a scale layout can win on quality (per-channel K scales keep int8 under 0.5% at 32K) and still
lose on speed, because not every layout has the C write pass and the fused decode-layers call
(docs/cpu-kernels.md). The attention kernel alone (`quantized_decode.py`) does not show that; this
times the whole engine step. Each format runs in its own process, the list round-robin `--rounds` times.

    python benchmarks/kv_scale_decode.py [--formats int8@token int8@channel] [--prompt 2048] [--new 128]
        [--dtype bfloat16] [--rounds 2] [--save FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time


def one(fmt: str, dtype: str, prompt_len: int, new: int) -> dict:
    from kvforge import LLM, SamplingParams
    from kvforge.ledger import parse_kv_format

    parsed = parse_kv_format(fmt)
    llm = LLM(dtype=dtype, k_cache_dtype=parsed.k_dtype, v_cache_dtype=parsed.v_dtype,
              kv_cache_scale=parsed.scales, kv_cache_rotation=parsed.rotation, kv_cache_memory="1GiB",
              max_model_len=prompt_len + new + 64, log_ledger=False)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    llm.generate(prompt_token_ids=[prompt[:64]], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    llm.reset_prefix_cache()
    engine = llm.engine
    engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    t0, first, n = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            n = len(o.outputs[0].token_ids)
            if first is None and n:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"format": fmt, "ttft_s": first - t0, "decode_tok_s": (n - 1) / (end - first)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["int8@token", "int8@channel"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--save", default=None, help="also write the table to this file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one format
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.dtype, args.prompt, args.new)))
        return 0
    runs: dict[str, list[dict]] = {f: [] for f in args.formats}
    for r in range(args.rounds):
        for fmt in args.formats:
            out = subprocess.run([sys.executable, __file__, "--one", fmt, "--dtype", args.dtype, "--prompt",
                                  str(args.prompt), "--new", str(args.new)], check=True, capture_output=True, text=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[fmt].append(res)
            print(f"round {r + 1}/{args.rounds}: {fmt}: TTFT {res['ttft_s']:.2f} s, decode {res['decode_tok_s']:.1f} tok/s",
                  flush=True)
    base = sorted(x["decode_tok_s"] for x in runs[args.formats[0]])
    lines = [f"one stream, default model, {args.dtype}, {args.prompt}-token prompt, {args.new} new tokens, "
             f"{args.rounds} rounds (median, the upper one of an even count; range)",
             f"{'KV format':<22} {'TTFT s':>7} {'decode tok/s':>13} {'range':>13} {'vs first':>9}"]
    for fmt, rs in runs.items():
        dec = sorted(x["decode_tok_s"] for x in rs)
        ttft = sorted(x["ttft_s"] for x in rs)
        med = dec[len(dec) // 2]
        lines.append(f"{fmt:<22} {ttft[len(ttft) // 2]:>7.2f} {med:>13.1f} {dec[0]:>6.1f}-{dec[-1]:<6.1f} "
                     f"{med / base[len(base) // 2]:>8.2f}x")
    text = "\n".join(lines)
    print(text)
    if args.save:
        with open(args.save, "w") as f:
            f.write("# python " + " ".join(sys.argv) + "\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
