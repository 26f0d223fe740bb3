"""Structured-output overhead: the offline 32-request batch with a JSON schema on every request vs none.

The workload is offline.py's (random prompts U[32, 512] tokens, outputs U[32, 256], ignore_eos),
run through one kvforge engine twice per round: unconstrained, then with every request held
to a JSON schema whose shortest document is longer than any output (so both runs generate
exactly the same number of tokens and the ratio is the masks' cost: llguidance's batched fill
plus one masked fill of the logits per step). Rounds alternate, and each figure is the best
round.

    python benchmarks/structured_batch.py [--num-requests 32] [--max-output 256] [--rounds 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from offline import VOCAB, workload  # noqa: E402

# an array of at least 400 short strings: never complete within 256 tokens
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 400}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256, help="outputs are U[32, max-output] tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from kvforge import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(dtype=args.dtype, log_ledger=False)
    work = [(ids, min(n, args.max_output)) for ids, n in workload(args.num_requests, 0, VOCAB)]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, (_, n) in enumerate(work)]
    spec = StructuredOutputsParams(json=SCHEMA)
    constrained = [dataclasses.replace(p, structured_outputs=spec) for p in plain]
    prompts = [ids for ids, _ in work]
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=constrained[:2])  # warm-up: compile, caches
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", plain), ("json_schema", constrained)):
            start = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == sum(n for _, n in work), "a constrained request ended before its max_tokens"
            best[name] = max(best.get(name, 0.0), tokens / elapsed)
            print(f"{name:>14}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s", flush=True)
    ratio = best["json_schema"] / best["unconstrained"]
    print(json.dumps({"unconstrained_tok_s": round(best["unconstrained"], 1),
                      "json_schema_tok_s": round(best["json_schema"], 1), "ratio": round(ratio, 3),
                      "num_requests": args.num_requests, "max_output": args.max_output, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
