"""Shared-prefix workload: what prefix caching buys an agent/chat workload.

32 requests share a 384-token prefix (a system prompt) and each adds a unique
32-token suffix; each generates 32 tokens (greedy, ignore_eos). All requests are
submitted at once (offline), so time to first token is measured from arrival and
includes queueing. The same engine runs the workload with prefix caching off and
on (the cache is reset between runs and after a warm-up); outputs must match.

    python benchmarks/shared_prefix.py [--model PATH] [--device cpu|cuda] [--save benchmarks/results/YYYY-MM-DD_shared_prefix.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

SYSTEM = (
    "You are Forge, a careful assistant for the operations team of a mid-sized logistics company. "
    "Answer questions about shipments, warehouses, customs paperwork and carrier contracts. Always cite the "
    "policy section you rely on, say when you are unsure, and never invent tracking numbers. Policies: "
    "(1) Refunds above 500 euros need a manager's approval. (2) Hazardous goods follow ADR rules. "
    "(3) Customs declarations must list HS codes for every line item. (4) Carriers are rated monthly on "
    "on-time delivery, damage rate and invoice accuracy. (5) Personal data stays inside the EU. "
)


def workload(tokenizer, num_requests: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    """Token-exact prompts: the same `prefix_len` tokens, then `suffix_len` tokens unique to each request."""
    prefix = tokenizer.encode(SYSTEM * (1 + prefix_len // 60))[:prefix_len]
    assert len(prefix) == prefix_len, "SYSTEM text too short for the requested prefix"
    prompts = []
    for i in range(num_requests):
        suffix = tokenizer.encode(f" Question {i}: where is shipment {1000 + 37 * i} and which policy applies "
                                  f"to its refund of {20 + i} euros? Please answer in detail, step by step, "
                                  "citing sections.", add_special_tokens=False)[:suffix_len]
        assert len(suffix) == suffix_len, "suffix text too short"
        prompts.append(prefix + suffix)
    return prompts


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), without numpy."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def run_once(llm, prompts: list[list[int]], output_len: int, caching: bool) -> dict:
    from kvforge import SamplingParams
    from kvforge.kv.stats import PrefixCacheStats

    engine = llm.engine
    engine.reset_prefix_cache()
    for pool in engine.kv.pools:
        pool.enable_caching = caching
    engine.kv.stats = PrefixCacheStats()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttfts = [o.metrics.time_to_first_token for o in outs]
    stats = engine.kv.stats
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return {
        "prefix_caching": caching,
        "wall_s": wall,
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "hit_rate": stats.hit_rate,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "_tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--save", default=os.path.join(os.path.dirname(__file__), "results", time.strftime("%Y-%m-%d") + "_shared_prefix.json"))
    args = ap.parse_args()

    from kvforge import LLM

    t0 = time.perf_counter()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, log_ledger=False,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(64, args.num_requests))
    load_s = time.perf_counter() - t0
    prompts = workload(llm.tokenizer, args.num_requests, args.prefix_len, args.suffix_len)
    # warm-up on unrelated tokens so the first measured run pays no one-off costs
    warm = [[(t + 7) % 1000 + 100 for t in p] for p in prompts[:4]]
    run_once(llm, warm, 4, caching=False)
    runs = [run_once(llm, prompts, args.output_len, caching) for caching in (False, True)]
    identical = runs[0].pop("_tokens") == runs[1].pop("_tokens")

    print(f"shared prefix: {args.num_requests} requests x ({args.prefix_len} shared + {args.suffix_len} unique) "
          f"prompt tokens, {args.output_len} output tokens each; device {llm.engine.device}, {args.dtype}")
    header = f"{'prefix caching':>14} {'wall s':>8} {'TTFT mean ms':>13} {'TTFT p99 ms':>12} {'hit rate':>9} {'out tok/s':>10}"
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{'on' if r['prefix_caching'] else 'off':>14} {r['wall_s']:8.2f} {r['ttft_mean_s'] * 1e3:13.1f} "
              f"{r['ttft_p99_s'] * 1e3:12.1f} {r['hit_rate']:9.1%} {r['output_tokens_per_s']:10.1f}")
    off, on = runs
    print(f"speed-up with caching: wall {off['wall_s'] / on['wall_s']:.2f}x, mean TTFT "
          f"{off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x; outputs identical: {identical}")
    result = {
        "workload": {k: getattr(args, k) for k in ("num_requests", "prefix_len", "suffix_len", "output_len",
                                                    "max_num_batched_tokens")},
        "model": args.model or "SmolLM2-135M-Instruct (GGUF)", "device": str(llm.engine.device), "dtype": args.dtype,
        "host": platform.node(), "cpu_threads": __import__("torch").get_num_threads(), "load_s": load_s,
        "load_avg_1m_at_end": os.getloadavg()[0],  # shared CPUs: a busy machine inflates every time
        "runs": runs, "outputs_identical": identical, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.save:
        os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
        with open(args.save, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
