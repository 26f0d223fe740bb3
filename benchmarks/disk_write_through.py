"""What writing KV blocks through to the disk tier costs, and what it buys (docs/security.md).

Runs the same batch of distinct prompts on one engine with a disk tier, alternating
write-through on (the default, `DiskTier.write_budget` 64 MiB) and off (budget 0: the disk
is written only at eviction and at exit). For each round: the batch's wall time, and the
share of its prompt blocks on disk once the writes queued when `generate` returned have
landed: what a SIGKILL a moment later would keep. Ratios come from alternating rounds of one run.

    python benchmarks/disk_write_through.py --prompts 16 --prompt-tokens 256 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from kvforge import LLM, SamplingParams
from kvforge.kv.tiers.keys import tier_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as disk:
        llm = LLM(args.model, kv_disk_cache=disk, max_model_len=args.prompt_tokens + args.max_tokens + 16,
                  log_ledger=False)
        tiers, vocab = llm.engine.tiers, llm.engine.model_config.vocab_size
        budget = tiers.disk.write_budget
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        rng = random.Random(0)
        times: dict[str, list[float]] = {"on": [], "off": []}
        durable: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                tiers.disk.write_budget = budget if mode == "on" else 0
                prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
                start = time.perf_counter()
                llm.generate(prompt_token_ids=prompts, sampling_params=params)
                times[mode].append(time.perf_counter() - start)
                keys = [tier_key(tiers.namespace, h) for req in _hashes(llm, prompts) for h in req]
                tiers.disk.flush()  # queued writes land within milliseconds; a SIGKILL before that loses them
                on_disk = sum(os.path.exists(tiers.disk.path(k)) for k in keys)
                durable[mode].append(on_disk / max(1, len(keys)))
        for mode in ("on", "off"):
            print(f"write-through {mode:>3}: batch {statistics.median(times[mode]):.3f} s median "
                  f"({', '.join(f'{t:.3f}' for t in times[mode])}); prompt blocks on disk once queued "
                  f"writes land: {statistics.mean(durable[mode]):.0%}")
        ratio = statistics.median(times["on"]) / statistics.median(times["off"])
        print(f"write-through on / off batch time: {ratio:.3f}x; disk bytes written: "
              f"{tiers.disk.bytes_written / 1e6:.1f} MB")
        llm.close()


def _hashes(llm: LLM, prompts: list[list[int]]) -> list[list[bytes]]:
    from kvforge.kv.hashing import extend_block_hashes

    bs = llm.engine.kv.block_size
    return [extend_block_hashes([], p, bs) for p in prompts]


if __name__ == "__main__":
    main()
