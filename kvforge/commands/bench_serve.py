"""`kvforge bench serve`: load-test an OpenAI-compatible server, like `vllm bench serve`.

Prints request and token throughput, TTFT, TPOT, ITL and end-to-end latency
(mean, median, p99) and the failures; `--save-json` keeps the raw figures.
Talks HTTP only (no torch import), so it can measure any server, not just kvforge.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from kvforge import envs
from kvforge.commands.bench_datasets import check_dataset_args, random_dataset, shared_prefix_dataset

if TYPE_CHECKING:  # the HTTP client (httpx) is imported when the benchmark runs, not when the parser is built
    from kvforge.commands.bench_client import RequestResult

HELP = "load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model id to send (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $KVFORGE_API_KEY)")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens) per request (suffix for shared-prefix)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (EOS ignored)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by +-this fraction")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: words in each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--save-json", default=None, metavar="PATH", help="write the summary and per-request figures here")


def _stats(values: list[float]) -> dict[str, float]:
    """mean / median / p99 in milliseconds (0 when there is nothing to measure)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ms = sorted(v * 1000.0 for v in values)
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p99": percentile(ms, 99)}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.success})[:10],
    }


def format_table(s: dict, title: str) -> str:
    w = 50
    rows = [
        ("Successful requests:", f"{s['completed']}"), ("Failed requests:", f"{s['failed']}"),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", f"{s['total_input_tokens']}"),
        ("  of which prefix-cached:", f"{s['cached_input_tokens']}"),
        ("Total generated tokens:", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    lines = [f" {title} ".center(w, "="), *(f"{k:<36}{v:>14}" for k, v in rows)]
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f" {name} ".center(w, "-"))
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {key[:-3].upper()} (ms):':<36}{s[key][stat]:>14.2f}")
    for err in s["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * w)
    return "\n".join(lines)


def _resolve_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"--base-url {base_url}: cannot reach the server ({exc})") from exc
    if r.status_code != 200:
        raise ValueError(f"--base-url {base_url}: GET /v1/models answered HTTP {r.status_code}; pass --model/--api-key")
    return r.json()["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    from kvforge.commands.bench_client import LoadConfig, run_load

    check_dataset_args(args)
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    api_key = args.api_key or envs.KVFORGE_API_KEY
    model = args.model or _resolve_model(args.base_url, api_key)
    if args.dataset == "random":
        reqs = random_dataset(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    else:
        reqs = shared_prefix_dataset(args.num_prompts, args.prefix_len, args.num_prefixes, args.input_len,
                                     args.output_len, args.range_ratio, args.seed)
    cfg = LoadConfig(args.base_url.rstrip("/"), model, chat=args.endpoint == "chat", api_key=api_key,
                     request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                     temperature=args.temperature, seed=args.seed, timeout=args.timeout)
    results, duration = asyncio.run(run_load(cfg, reqs))
    summary = summarize(results, duration)
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    conc = f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""
    print(format_table(summary, f"Serving Benchmark Result (rate {rate} req/s{conc})"))
    if args.save_json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
        config["request_rate"] = rate
        raw = {"config": {**config, "model": model}, "summary": summary,
               "requests": [asdict(r) for r in results]}
        with open(args.save_json, "w") as f:
            json.dump(raw, f, indent=1)
        print(f"raw figures written to {args.save_json}", file=sys.stderr)
    return 0 if summary["completed"] else 1
