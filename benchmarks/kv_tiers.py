"""KV tiers: what a disk (and host) tier buys multi-turn chat, a restart, and preemption.

Three cases on the default model (SmolLM2-135M-Instruct, fp32: 720 KiB per 16-token block):

1. chat: C conversations of T turns, each with its own long history; turn t of every
   conversation runs before turn t+1 (one request at a time, so TTFT is the prefill),
   and the device pool holds about two conversations, so a history is evicted before
   its next turn. Mean TTFT of turns 2..T: recompute (no tiers) vs disk tier vs host+disk.
2. restart: a 2K-token prefix is served, the engine is closed (cached blocks flushed to
   disk) and the KV cache rebuilt from scratch on the same directory (pool, host tier and
   disk index all new; the weights are kept to save loading time); TTFT of its first
   request vs a cold start on an empty directory.
3. swap: many long requests at once in a pool too small for them, so the scheduler
   preempts; recompute-only (no tiers) vs swap chosen by cost (host tier, preemption_mode
   auto). Wall time and outputs.

Outputs must be identical in every configuration. The machine this ran on is shared:
compare ratios within one run, not absolute times.

    python benchmarks/kv_tiers.py [--conversations 32 --turns 6] [--cases chat,restart,swap]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

DOC = ("The warehouse log records every pallet that enters or leaves the site, with its carrier, its weight, "
       "the dock it used and the customs status of each line item. Operators reconcile the log each evening "
       "against the carrier manifests and flag any difference larger than two percent. ")


def tokens(tok, text: str, n: int) -> list[int]:
    ids = tok.encode(text * (1 + n // 4), add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


def ttft_one(llm, prompt: list[int], max_tokens: int):
    from kvforge import SamplingParams

    (out,) = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                          sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return out.metrics.time_to_first_token, out


def reconfigure(llm, **tiers) -> None:
    base = {"kv_offload_memory": None, "kv_disk_cache": None, "kv_disk_size": None, "preemption_mode": "auto"}
    llm.engine.reconfigure_kv_cache(**{**base, **tiers})


def chat_case(llm, args, workdir: str) -> dict:
    tok = llm.tokenizer
    histories0 = [tokens(tok, f"Conversation {c} about site {c * 7}. " + DOC, args.history) for c in range(args.conversations)]
    users = [[tokens(tok, f" Question {t} for conversation {c}: what changed at dock {t + c}?", args.user)
              for t in range(args.turns)] for c in range(args.conversations)]
    per_conv = -(-(args.history + args.turns * (args.user + args.answer)) // 16)
    configs = {
        "recompute": {},
        "disk": {"kv_disk_cache": os.path.join(workdir, "chat-disk")},
        "host+disk": {"kv_disk_cache": os.path.join(workdir, "chat-host-disk"), "kv_offload_memory": args.host_memory},
    }
    results, outputs = {}, {}
    for name, tiers in configs.items():
        reconfigure(llm, num_kv_blocks=int(args.pool_conversations * per_conv), **tiers)
        histories = [list(h) for h in histories0]
        ttfts: dict[int, list[float]] = {}
        outs = []
        for t in range(args.turns):
            for c in range(args.conversations):
                prompt = histories[c] + users[c][t]
                ttft, out = ttft_one(llm, prompt, args.answer)
                ttfts.setdefault(t, []).append(ttft)
                histories[c] = prompt + out.outputs[0].token_ids
                outs.append(out.outputs[0].token_ids)
        later = [x for t in range(1, args.turns) for x in ttfts[t]]
        stats = llm.engine.tier_stats()
        llm.engine.close()
        results[name] = {"ttft_turn1_ms": 1e3 * sum(ttfts[0]) / len(ttfts[0]),
                         "ttft_later_ms": 1e3 * sum(later) / len(later), "tiers": stats}
        print(f"  chat {name}: TTFT turn 1 {results[name]['ttft_turn1_ms']:.1f} ms, turns 2+ "
              f"{results[name]['ttft_later_ms']:.1f} ms", flush=True)
        outputs[name] = outs
    base = results["recompute"]["ttft_later_ms"]
    print(f"\nchat: {args.conversations} conversations x {args.turns} turns, history {args.history} tokens, "
          f"+{args.user} user +{args.answer} answer tokens per turn; device pool {args.pool_conversations} "
          f"conversations ({int(args.pool_conversations * per_conv)} blocks)")
    print(f"{'config':>10} {'TTFT turn 1 ms':>15} {'TTFT turns 2+ ms':>17} {'speed-up':>9}  tier hits / bytes")
    for name, r in results.items():
        detail = "; ".join(f"{t}: hit {s['hit_rate']:.0%} of {s['query_tokens']} tok, wrote {s['bytes_written'] / 2**20:.0f} "
                           f"MiB, read {s['bytes_read'] / 2**20:.0f} MiB, load {s['load_seconds']:.2f} s"
                           for t, s in r["tiers"].items()) or "-"
        r["speedup_later"] = base / r["ttft_later_ms"]
        print(f"{name:>10} {r['ttft_turn1_ms']:15.1f} {r['ttft_later_ms']:17.1f} {r['speedup_later']:8.2f}x  {detail}")
    identical = all(o == outputs["recompute"] for o in outputs.values())
    print(f"outputs identical: {identical}")
    return {"results": results, "outputs_identical": identical}


def restart_case(llm, args, workdir: str) -> dict:
    prompt = tokens(llm.tokenizer, "Restart test. " + DOC, args.restart_prefix)
    ask = tokens(llm.tokenizer, " Summarise the log.", 8)
    disk = os.path.join(workdir, "restart-disk")
    reconfigure(llm, num_kv_blocks=None, kv_disk_cache=disk)
    _, first = ttft_one(llm, prompt + ask, args.answer)
    llm.engine.close()
    reconfigure(llm, num_kv_blocks=None, kv_disk_cache=disk)  # a fresh pool, host tier and disk index
    warm_ttft, warm = ttft_one(llm, prompt + ask, args.answer)
    cached = dict(warm.num_cached_tokens_by_tier)
    llm.engine.close()
    reconfigure(llm, num_kv_blocks=None, kv_disk_cache=os.path.join(workdir, "restart-empty"))
    cold_ttft, cold = ttft_one(llm, prompt + ask, args.answer)
    llm.engine.close()
    identical = first.outputs[0].token_ids == warm.outputs[0].token_ids == cold.outputs[0].token_ids
    print(f"\nrestart: first request of a known {args.restart_prefix}-token prefix after a restart on the same disk cache")
    print(f"  cold (empty directory)  TTFT {cold_ttft * 1e3:8.1f} ms")
    print(f"  warm (same directory)   TTFT {warm_ttft * 1e3:8.1f} ms  ({cached})")
    print(f"  speed-up {cold_ttft / warm_ttft:.2f}x; outputs identical: {identical}")
    return {"cold_ttft_ms": cold_ttft * 1e3, "warm_ttft_ms": warm_ttft * 1e3, "speedup": cold_ttft / warm_ttft,
            "cached_tokens_by_tier": cached, "outputs_identical": identical}


def swap_case(llm, args, workdir: str) -> dict:
    from kvforge import SamplingParams

    prompts = [tokens(llm.tokenizer, f"Request {i}. " + DOC, args.swap_prompt) for i in range(args.swap_requests)]
    per_req = -(-(args.swap_prompt + args.swap_output) // 16)
    params = SamplingParams(temperature=0, max_tokens=args.swap_output, ignore_eos=True)
    runs = {}
    for name, tiers in (("recompute only", {}), ("swap by cost", {"kv_offload_memory": args.host_memory})):
        reconfigure(llm, num_kv_blocks=int(2.5 * per_req), **tiers)
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - start
        sched = llm.engine.scheduler
        stats = llm.engine.tier_stats()
        runs[name] = {"wall_s": wall, "preemptions": sched.num_preemptions, "swaps": sched.num_swaps,
                      "host_hit_tokens": stats.get("host", {}).get("hit_tokens", 0),
                      "_tokens": [o.outputs[0].token_ids for o in outs]}
        llm.engine.close()
    identical = runs["recompute only"].pop("_tokens") == runs["swap by cost"].pop("_tokens")
    cost = None
    print(f"\nswap: {args.swap_requests} requests x ({args.swap_prompt} prompt + {args.swap_output} output) tokens "
          f"at once, pool of {int(2.5 * per_req)} blocks (2.5 requests)")
    for name, r in runs.items():
        print(f"  {name:>15}: wall {r['wall_s']:7.2f} s, {r['preemptions']} preemptions, {r['swaps']} swapped out, "
              f"{r['host_hit_tokens']} tokens loaded from host")
    speed = runs["recompute only"]["wall_s"] / runs["swap by cost"]["wall_s"]
    print(f"  swap by cost vs recompute only: {speed:.2f}x; outputs identical: {identical}")
    return {"runs": runs, "speedup": speed, "outputs_identical": identical, "cost": cost}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cases", default="chat,restart,swap")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--history", type=int, default=1024, help="tokens of each conversation's history at turn 1")
    ap.add_argument("--user", type=int, default=32, help="user tokens added per turn")
    ap.add_argument("--answer", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--pool-conversations", type=float, default=2.0, help="device pool size, in conversations")
    ap.add_argument("--host-memory", default="256MiB")
    ap.add_argument("--restart-prefix", type=int, default=2048)
    ap.add_argument("--swap-requests", type=int, default=6)
    ap.add_argument("--swap-prompt", type=int, default=256)
    ap.add_argument("--swap-output", type=int, default=192)
    ap.add_argument("--save", default=os.path.join(os.path.dirname(__file__), "results", time.strftime("%Y-%m-%d") + "_kv_tiers.json"))
    args = ap.parse_args()

    from kvforge import LLM

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, log_ledger=False)
    warm = tokens(llm.tokenizer, DOC, 300)  # one-off costs (kernels, allocator) before anything is timed
    ttft_one(llm, warm, 2)
    workdir = tempfile.mkdtemp(prefix="kvforge-tiers-bench-")
    result = {"model": args.model or "SmolLM2-135M-Instruct (GGUF)", "device": str(llm.engine.device),
              "dtype": args.dtype, "host": platform.node(), "args": vars(args)}
    try:
        cases = {"chat": chat_case, "restart": restart_case, "swap": swap_case}
        for name in args.cases.split(","):
            result[name] = cases[name](llm, args, workdir)
        reconfigure(llm, num_kv_blocks=None, kv_offload_memory=args.host_memory,
                    kv_disk_cache=os.path.join(workdir, "ledger"))
        print("\nstart-up ledger rows of the tiers (host + disk):")
        print("\n".join(f"  {k:<18}  {v}" for k, v in llm.engine.report.tiers))
        result["ledger_rows"] = llm.engine.report.tiers
        llm.engine.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["load_avg_1m_at_end"] = os.getloadavg()[0]
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.save:
        os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
        with open(args.save, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
