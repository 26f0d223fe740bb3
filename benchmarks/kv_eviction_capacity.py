"""Long-context batch at equal KV memory, with and without KV eviction.

16 prompts of 2K tokens of CPython documentation, 64 greedy tokens each, one KV pool sized for a few
full-length sequences. With eviction (default: snapkv at 20% of the prompt) a sequence holds its prompt
while prefilling, then budget + 1 block, so more sequences run at once. Reports the most sequences
running at once, the mean running per step, preemptions, output tok/s and wall time for both.

    python benchmarks/kv_eviction_capacity.py                 # default model, 16 x 2048 + 64
    python benchmarks/kv_eviction_capacity.py --num-prompts 4 --prompt-len 512 --full-seqs 1   # quick
"""
from __future__ import annotations

import argparse
import json
import time

from kvforge.engine.args import EngineArgs
from kvforge.engine.engine import LLMEngine
from kvforge.engine.sampling_params import SamplingParams
from kvforge.evaluation.kv_quant import corpus_windows


def run(args: argparse.Namespace, eviction: str | None) -> dict:
    bs = 16
    blocks = args.full_seqs * -(-(args.prompt_len + args.output_len) // bs)
    budget = int(args.prompt_len * args.budget) // bs * bs
    extra = dict(kv_eviction=eviction, kv_budget=budget) if eviction else {}
    engine = LLMEngine(EngineArgs(model=args.model, block_size=bs, num_kv_blocks=blocks, max_num_seqs=64,
                                  max_num_batched_tokens=args.max_num_batched_tokens, log_ledger=False, **extra))
    prompts = corpus_windows(engine.tokenizer, args.prompt_len, args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(None, params, prompt)
    peak, running_sum, steps, out_tokens = 0, 0, 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        n = len(engine.scheduler.running)
        peak, running_sum, steps = max(peak, n), running_sum + n, steps + 1
    wall = time.perf_counter() - t0
    out_tokens = engine.counters.num_generation_tokens
    engine.check_integrity()
    return {"eviction": f"{eviction} @ {budget} tokens" if eviction else "none", "kv_blocks": blocks,
            "peak_running": peak, "mean_running": running_sum / steps, "preemptions": engine.scheduler.num_preemptions,
            "output_tok_s": out_tokens / wall, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--full-seqs", type=int, default=4, help="KV pool = this many full-length sequences")
    p.add_argument("--budget", type=float, default=0.2, help="eviction budget as a share of the prompt")
    p.add_argument("--policy", default="snapkv", choices=("streaming", "h2o", "snapkv"))
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--save-json", default=None)
    args = p.parse_args()
    rows = [run(args, None), run(args, args.policy)]
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} out, KV pool = "
          f"{rows[0]['kv_blocks']} blocks of 16 ({args.full_seqs} full sequences)")
    print("| eviction | peak running | mean running | preemptions | output tok/s | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['eviction']} | {r['peak_running']} | {r['mean_running']:.1f} | {r['preemptions']} | "
              f"{r['output_tok_s']:.1f} | {r['wall_s']:.1f} |")
    print(f"peak sequences at once: {rows[1]['peak_running'] / rows[0]['peak_running']:.1f}x, "
          f"wall time {rows[0]['wall_s'] / rows[1]['wall_s']:.2f}x faster with eviction")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
