"""`kvforge learn why-cache`: what the KV cache saves, first in NumPy, then on the real model.

Without a cache, producing the token after a T-token context means running the
model over all T tokens again (their K/V projections are recomputed): the cost
per token grows with T and a whole sequence costs O(T^2). With the cache, one
decode step runs one token through the weights and reads T cached K/V rows: its
cost is dominated by the weights and stays nearly flat as T grows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.learn.common import fmt_g, fmt_ms, log_log_axes, now, random_prompts, render_table
from kvforge.learn.flops import ModelShape, decode_step_flops, no_cache_step_flops

CONTEXTS = (64, 128, 256, 512, 1024, 2048)
QUICK_CONTEXTS = (64, 256)
TARGET_NO_CACHE_GROWTH, TARGET_CACHE_GROWTH = 10.0, 1.5


@dataclass(slots=True)
class Row:
    context: int
    cached_s: float  # one decode step with the cache at this context
    no_cache_s: float  # the same next token by recomputing the whole prefix
    cached_flops: int
    no_cache_flops: int


def numpy_check(d: int = 64, num_tokens: int = 256, prompt_len: int = 16, seed: int = 0) -> dict[str, float]:
    """The minimal cache vs full recomputation on random inputs: max difference and K/V rows computed."""
    import numpy as np

    from kvforge.learn.minimal_cache import SingleHeadAttention, run_both

    attn = SingleHeadAttention(d, seed)
    tokens = np.random.default_rng(seed + 1).standard_normal((num_tokens, d))
    cached, recomputed = run_both(attn, tokens, prompt_len)
    rows_no_cache = sum(t + 1 for t in range(prompt_len - 1, num_tokens))
    return {"d": d, "tokens": num_tokens, "max_abs_diff": float(np.abs(cached - recomputed).max()),
            "kv_rows_cached": num_tokens, "kv_rows_no_cache": rows_no_cache}


def generate_without_cache(engine: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens produced by recomputing the whole sequence for every token (prefix caching must be off)."""
    from kvforge.engine.sampling_params import SamplingParams

    if engine.kv.enable_caching:
        raise ValueError("generate_without_cache needs an engine with prefix caching off")
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        token = _run(engine, seq, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
        out.append(token)
        seq.append(token)
    return out


def _run(engine: Any, prompt: list[int], params: Any) -> list[int]:
    """Step `engine` until this one request finishes; its output token ids."""
    rid = engine.add_request(prompt_token_ids=prompt, params=params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids


def time_cached(engine: Any, prompt: list[int], steps: int) -> tuple[float, float]:
    """(prefill seconds, fastest decode step seconds) of one request with the cache.

    The prefill is exactly what a cache-less engine does for every token: compute the whole
    prefix to get the next token, so it is also a no-cache sample.
    """
    from kvforge.engine.sampling_params import SamplingParams

    rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=steps + 1,
                                                                           ignore_eos=True))
    prefill_s, times, produced, done = 0.0, [], 0, False
    while not done:
        t = now()
        outs = engine.step()
        elapsed = now() - t
        mine = [o for o in outs if o.request_id == rid]
        if produced > 0:  # the request already had its first token: this step was a pure decode
            times.append(elapsed)
        else:
            prefill_s += elapsed
        produced += sum(len(o.outputs[0].delta_token_ids) for o in mine)
        done = any(o.finished for o in mine)
    return prefill_s, min(times)


def time_no_cache_token(engine: Any, prompt: list[int], repeats: int) -> float:
    """Fastest time (seconds) to get the next token of `prompt` by computing the whole prefix."""
    from kvforge.engine.sampling_params import SamplingParams

    best = float("inf")
    for _ in range(repeats):
        t = now()
        _run(engine, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        best = min(best, now() - t)
    return best


def measure(engine: Any, contexts: tuple[int, ...], decode_steps: int = 6, repeats: int = 1) -> list[Row]:
    """`repeats` no-cache runs per context on top of the cached run's own prefill (best of them is kept)."""
    shape = ModelShape.from_config(engine.model_config)
    rows = []
    for i, ctx in enumerate(contexts):
        (prompt,) = random_prompts(1, ctx, engine.model_config.vocab_size, seed=i)
        prefill_s, cached = time_cached(engine, prompt, decode_steps)
        no_cache = min(prefill_s, time_no_cache_token(engine, prompt, repeats))
        rows.append(Row(ctx, cached, no_cache, decode_step_flops(shape, ctx), no_cache_step_flops(shape, ctx)))
    return rows


def growth(rows: list[Row]) -> tuple[float, float]:
    """(no-cache, cached) per-token time at the longest context over the shortest."""
    return rows[-1].no_cache_s / rows[0].no_cache_s, rows[-1].cached_s / rows[0].cached_s


def render(check: dict[str, float], rows: list[Row], label: str) -> str:
    lines = [
        "why-cache: " + __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
        "",
        f"NumPy single-head attention (kvforge/learn/minimal_cache.py), d={check['d']}, {check['tokens']} tokens:",
        f"  max |cached - recomputed| = {check['max_abs_diff']:.1e};  K/V rows computed: "
        f"{check['kv_rows_cached']:,} with the cache, {check['kv_rows_no_cache']:,} without",
        "",
        f"Real model through kvforge ({label}): time and FLOPs per generated token",
        render_table(
            ["context", "cached ms", "cached GFLOP", "no-cache ms", "no-cache GFLOP", "slowdown"],
            [[r.context, fmt_ms(r.cached_s), fmt_g(r.cached_flops), fmt_ms(r.no_cache_s), fmt_g(r.no_cache_flops),
              f"{r.no_cache_s / r.cached_s:.1f}x"] for r in rows],
        ),
    ]
    if len(rows) > 1:
        g_none, g_cache = growth(rows)
        lines.append(
            f"per-token time {rows[0].context} -> {rows[-1].context} tokens: without cache x{g_none:.1f} "
            f"(target >= {TARGET_NO_CACHE_GROWTH:g}x), with cache x{g_cache:.2f} (target <= {TARGET_CACHE_GROWTH:g}x)"
        )
    lines.append("(times: fastest of the measured steps; FLOPs: 2 per weight per token + 4 x heads x head_dim per "
                 "query-key pair, kvforge/learn/flops.py)")
    return "\n".join(lines)


def plot(ax: Any, rows: list[Row]) -> None:
    ctx = [r.context for r in rows]
    ax.plot(ctx, [r.no_cache_s * 1e3 for r in rows], "o-", label="no cache (recompute prefix)")
    ax.plot(ctx, [r.cached_s * 1e3 for r in rows], "s-", label="KV cache (one decode step)")
    log_log_axes(ax, "context length (tokens)", "ms per generated token", "why-cache: time per token as the context grows", 2)


def run(args: Any) -> int:
    from kvforge.learn.common import make_engine, model_label, save_plot

    contexts = tuple(args.contexts) if args.contexts else (QUICK_CONTEXTS if args.quick else CONTEXTS)
    steps = 3 if args.quick else 8
    check = numpy_check(num_tokens=64 if args.quick else 256)
    longest = max(contexts) + steps + 2
    engine = make_engine(args.model, args.dtype, args.threads, enable_prefix_caching=False, max_model_len=longest + 1,
                         max_num_batched_tokens=max(longest, 1024), num_kv_blocks=-(-longest // 16) + 4,
                         max_num_seqs=4)
    rows = measure(engine, contexts, steps, repeats=0 if args.quick else 1)
    print(render(check, rows, model_label(engine, args.model)))
    if args.plot:
        save_plot(args.plot, lambda ax: plot(ax, rows))
        print(f"plot saved to {args.plot}")
    return 0
