"""Routing replicas by their KV caches vs Ray Serve's default, and tensor-parallel step time.

Part 1 (routing): a shared-prefix workload (N distinct system prompts, each ~P tokens, a short
unique question after it) sent by an OpenAI-style streaming client with fixed concurrency to two
kvforge replicas on Ray Serve (1 CPU each, local Ray on loopback). Each policy gets fresh replicas
(cold caches) and the same request order:

- kv-aware: kvforge's KVAffinityRequestRouter (exact block-hash events from the replicas);
- pow2: Ray Serve's default PowerOfTwoChoicesRequestRouter;
- prefix-tree (reimplementation): Ray Serve LLM's PrefixCacheAffinityRouter *policy as documented*
  (load balanced if max - min queue length < imbalanced_threshold=10; then the replica whose
  previously routed texts share the longest character prefix, if the match rate >= 0.1, else the
  replica with the fewest routed characters; imbalanced: power of two). Ray Serve LLM itself needs
  `ray[llm]` (vLLM), which this machine cannot install, so this is kvforge's reimplementation.

Reported: mean/p50/p99 TTFT, per-replica prefix-cache hit rate (from the replicas' own counters),
load skew (requests on the busier replica / mean), routing decisions.

Part 2 (tensor parallelism): mean decode-step and prefill time at TP=1 vs TP=2 (gloo, CPU).

    python benchmarks/routing.py     # 8 x 1K-token prefixes, 256 requests, concurrency 8 (~17 min on 2 cores)
    python benchmarks/routing.py --requests 64 --prefix-tokens 512 --kv-cache-memory 1GiB   # quick; pools hold every prefix

Each replica's KV pool (--kv-cache-memory) holding only part of the prefixes is the regime routing is for:
the replicas together hold every prefix only when each keeps its own share. With pools that hold every
prefix, any router reaches the same hit rate after one miss per prefix and replica.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ROOT = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prefix_tree_router():
    """The documented PrefixCacheAffinityRouter policy (kvforge's reimplementation, benchmarks/prefix_tree_router.py)."""
    from benchmarks.prefix_tree_router import PrefixTreeAffinityRouter

    return PrefixTreeAffinityRouter


def workload(args, tokenizer) -> list[tuple[int, str]]:
    rng = random.Random(0)
    words = "alpha beta gamma delta kernel cache block token router replica prefix latency".split()
    systems = []
    for p in range(args.prompts):
        text = f"System prompt {p}: you are assistant number {p}. "
        while len(tokenizer.encode(text)) < args.prefix_tokens:
            text += " ".join(rng.choice(words) for _ in range(32)) + ". "
        systems.append(text)
    reqs = [(i % args.prompts) for i in range(args.requests)]
    rng.shuffle(reqs)
    return [(p, systems[p] + f"\nQuestion {i}: what is {rng.randint(0, 10**6)}?") for i, p in enumerate(reqs)]


async def run_load(base: str, model: str, items: list[tuple[int, str]], concurrency: int, max_tokens: int):
    import httpx

    from kvforge.distributed.ray_serve import REPLICA_HEADER

    sem = asyncio.Semaphore(concurrency)
    results = []

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt: str):
            async with sem:
                start = time.perf_counter()
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
                async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    ttft = None
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and ttft is None and '"text"' in line:
                            ttft = time.perf_counter() - start
                    results.append((resp.headers[REPLICA_HEADER], ttft if ttft is not None else time.perf_counter() - start))

        await asyncio.gather(*(one(p) for _, p in items))
    return results


def replica_hit_rates() -> dict[str, float]:
    """Each replica's own prefix-cache hit rate (hit / queried tokens), asked of its actor directly, so
    every policy is measured the same way (only the KV-aware router polls the replicas itself)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    out = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == SERVE_NAMESPACE and "KVForgeServer" in actor["name"]:
            stats = ray.get(ray.get_actor(actor["name"], namespace=SERVE_NAMESPACE).record_routing_stats.remote())
            q = stats.get("prefix_queries", 0)
            out[str(stats.get("replica", actor["name"]))] = stats.get("prefix_hits", 0) / q if q else 0.0
    return out


def routing_part(args) -> list[dict]:
    import ray
    from ray import serve

    from kvforge.distributed.ray_serve import KVAffinityRequestRouter, build_app, init_local_ray, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    items = workload(args, tokenizer)
    init_local_ray(None, num_cpus=2)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    engine = {"model": args.model, "dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    rows = []
    policies = {"kv-aware": KVAffinityRequestRouter, "pow2 (Ray default)": None,
                "prefix-tree (reimpl.)": make_prefix_tree_router()}
    for name in args.policies.split(","):
        label = {"kv": "kv-aware", "pow2": "pow2 (Ray default)", "tree": "prefix-tree (reimpl.)"}[name]
        app = build_app(engine, "bench", num_replicas=2, router_class=policies[label],
                        router_kwargs={"max_load_ratio": args.max_load_ratio, "max_load_diff": args.max_load_diff}
                        if name == "kv" else None, stats_period_s=0.2)
        serve.run(app, name="kvforge", route_prefix="/")
        asyncio.run(run_load(base, "bench", [(0, "warm-up")], 1, 1))  # both replicas loaded
        t0 = time.perf_counter()
        res = asyncio.run(run_load(base, "bench", items, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # one more stats poll
        hits = replica_hit_rates()
        ttfts = sorted(t for _, t in res)
        per = {}
        for r, _ in res:
            per[r] = per.get(r, 0) + 1
        counts = list(per.values()) + [0] * (2 - len(per))
        rows.append({"policy": label, "mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": ttfts[len(ttfts) // 2],
                     "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "wall_s": wall,
                     "requests_per_replica": sorted(counts, reverse=True),
                     "load_skew": max(counts) / (sum(counts) / 2), "hit_rate_per_replica": hits})
        print(json.dumps(rows[-1]), flush=True)
        serve.delete("kvforge")
    serve.shutdown()
    ray.shutdown()
    return rows


def tp_model_path() -> str:
    """A random-weight Llama of SmolLM2-135M's size (576 hidden, 1536 MLP, 30 layers) with 8 query and 4 KV
    heads: SmolLM2's own 9 query / 3 KV heads cannot be split over 2 ranks. Step time depends on the shapes,
    not on the weights (TP=2 logits equal TP=1 within 1e-4 on the tests' models: tests/test_tensor_parallel.py)."""
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "..", "tests"))
    from tiny_models import build_tiny_model

    path = os.path.join(tempfile.gettempdir(), "kvforge-tp-bench-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, "llama_gqa", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=4)
    return path


def tp_part(args) -> list[dict]:
    from kvforge import LLM, SamplingParams

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    model = args.tp_model or tp_model_path()
    vocab = 250 if args.tp_model is None else 1000  # the generated model has a byte-level vocabulary
    prompts = [[(13 * i + j) % vocab + 3 for j in range(args.tp_prompt_len)] for i in range(args.tp_batch)]
    rows = []
    for tp in (1, 2):
        llm = LLM(model, dtype=args.dtype, tensor_parallel_size=tp, log_ledger=False,
                  kv_cache_memory="256MiB", enable_prefix_caching=False)
        eng = llm.engine
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
        for p in prompts:
            eng.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=args.tp_steps, ignore_eos=True))
        prefill, decode = [], []
        total = eng.counters.num_prompt_tokens + sum(len(p) for p in prompts)
        while eng.has_unfinished_requests():
            in_prefill = eng.counters.num_prompt_tokens < total  # steps that still carry prompt chunks
            t = time.perf_counter()
            eng.step()
            (prefill if in_prefill else decode).append(time.perf_counter() - t)
        rows.append({"tp": tp, "decode_step_ms": 1000 * statistics.mean(decode) if decode else float("nan"),
                     "prefill_steps_ms": 1000 * statistics.mean(prefill) if prefill else float("nan"),
                     "batch": args.tp_batch})
        print(json.dumps(rows[-1]), flush=True)
        eng.shutdown()
        del llm, eng
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kv-cache-memory", default="256MiB",
                    help="per replica; 256MiB of fp32 SmolLM2 KV holds ~5 of the 8 1K-token prefixes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-load-ratio", type=float, default=1.5)
    ap.add_argument("--max-load-diff", type=float, default=16.0)
    ap.add_argument("--policies", default="kv,pow2,tree")
    ap.add_argument("--skip-routing", action="store_true")
    ap.add_argument("--skip-tp", action="store_true")
    ap.add_argument("--tp-model", default=None, help="default: a random Llama of SmolLM2-135M's size, 8 heads / 4 KV heads")
    ap.add_argument("--tp-batch", type=int, default=8)
    ap.add_argument("--tp-prompt-len", type=int, default=128)
    ap.add_argument("--tp-steps", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", time.strftime("%Y-%m-%d") + "_routing.json"))
    args = ap.parse_args()
    out = {"args": vars(args)}
    if not args.skip_routing:
        rows = routing_part(args)
        out["routing"] = rows
        print(f"\n{'policy':<24}{'mean TTFT s':>12}{'p50':>8}{'p99':>8}{'wall s':>8}  per replica  skew  hit rate per replica")
        for r in rows:
            hits = ", ".join(f"{v:.0%}" for v in r["hit_rate_per_replica"].values()) or "-"
            print(f"{r['policy']:<24}{r['mean_ttft_s']:>12.3f}{r['p50_ttft_s']:>8.3f}{r['p99_ttft_s']:>8.3f}"
                  f"{r['wall_s']:>8.1f}  {str(r['requests_per_replica']):<11}  {r['load_skew']:.2f}  {hits}")
        base = {r["policy"]: r["mean_ttft_s"] for r in rows}
        if "kv-aware" in base and "pow2 (Ray default)" in base:
            print(f"kv-aware mean TTFT is {base['pow2 (Ray default)'] / base['kv-aware']:.2f}x lower than pow2")
        if "kv-aware" in base and "prefix-tree (reimpl.)" in base:
            print(f"kv-aware mean TTFT is {base['prefix-tree (reimpl.)'] / base['kv-aware']:.2f}x lower than prefix-tree")
    if not args.skip_tp:
        rows = tp_part(args)
        out["tensor_parallel"] = rows
        print(f"\n{'TP':<4}{'decode step ms':>16}{'prefill step ms':>17}  (batch {args.tp_batch}, gloo on CPU)")
        for r in rows:
            print(f"{r['tp']:<4}{r['decode_step_ms']:>16.1f}{r['prefill_steps_ms']:>17.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
