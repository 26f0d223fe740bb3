"""`kvforge learn paging`: paged blocks vs contiguous reservation, same workload, same KV memory.

A naive server reserves max_model_len slots for every sequence it admits, since it
cannot know how long the sequence will grow; most of that region stays empty, and
the reservation, not the tokens, decides how many sequences fit. Paging hands out
fixed-size blocks as tokens arrive, so a sequence wastes at most the unfilled tail of
its last block, more sequences run at once, and each decode step does more useful
work. Both modes run in the real engine (`--kv-allocation contiguous|paged`);
utilization and concurrency are read from the engine's own stats (kvforge/kv/utilization.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvforge.learn.common import now, random_prompts, render_table

FULL = {"num_requests": 32, "max_model_len": 512, "contiguous_seqs": 8, "prompt": (16, 192), "output": (16, 256)}
QUICK = {"num_requests": 12, "max_model_len": 256, "contiguous_seqs": 3, "prompt": (8, 64), "output": (8, 64)}
TARGET_CONCURRENCY, TARGET_THROUGHPUT = 2.0, 1.5


@dataclass(slots=True)
class ModeResult:
    mode: str
    wall_s: float
    output_tokens: int
    stats: dict[str, float]  # the engine's KVUtilizationStats.as_dict() plus means
    mean_request_utilization: float  # RequestOutput.metrics.kv_utilization, averaged
    kv_bytes_per_token: float
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def workload(cfg: dict[str, Any], vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Mixed lengths: prompt and output lengths uniform in their ranges (fixed seed: same for both modes)."""
    rng = random.Random(seed)
    n = cfg["num_requests"]
    prompt_lens = [rng.randint(*cfg["prompt"]) for _ in range(n)]
    out_lens = [rng.randint(*cfg["output"]) for _ in range(n)]
    return random_prompts(n, prompt_lens, vocab, seed=seed), out_lens


def run_mode(engine: Any, mode: str, prompts: list[list[int]], out_lens: list[int]) -> ModeResult:
    from kvforge import ledger
    from kvforge.engine.sampling_params import SamplingParams

    engine.reconfigure_kv_cache(kv_allocation=mode)  # same weights, same number of blocks, fresh stats
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
           for p, k in zip(prompts, out_lens)]
    finals: dict[str, Any] = {}
    t = now()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    wall = now() - t
    usage = engine.kv_usage
    stats = usage.as_dict()
    steps = max(usage.num_steps, 1)
    stats.update(mean_running_seqs=usage.sum_running_seqs / steps, mean_slots=usage.sum_slots_allocated / steps,
                 mean_tokens=usage.sum_tokens_stored / steps)
    per_req = [finals[i].metrics.kv_utilization for i in ids]
    kvpt = ledger.kv_bytes_per_token(engine.model_config.kv_shape(), engine.cache_format, engine.kv.block_size)
    return ModeResult(mode, wall, sum(len(finals[i].outputs[0].token_ids) for i in ids), stats,
                      sum(per_req) / len(per_req), kvpt, [finals[i].outputs[0].token_ids for i in ids])


def render(results: list[ModeResult], cfg: dict[str, Any], num_blocks: int, block_size: int, label: str) -> str:
    def mib(tokens: float, r: ModeResult) -> str:
        return f"{tokens * r.kv_bytes_per_token / 2**20:.1f}"

    rows = []
    for r in results:
        s = r.stats
        waste_per_seq = (s["mean_slots"] - s["mean_tokens"]) / max(s["mean_running_seqs"], 1e-9)
        rows.append([r.mode, mib(s["mean_slots"], r), mib(s["mean_tokens"], r), f"{100 * s['kv_mean_utilization']:.1f}%",
                     f"{100 * (1 - s['kv_mean_utilization']):.1f}%", f"{waste_per_seq:.1f}",
                     f"{100 * r.mean_request_utilization:.1f}%", int(s["peak_running_seqs"]),
                     f"{s['mean_running_seqs']:.1f}", r.output_tokens, f"{r.wall_s:.1f}", f"{r.tokens_per_s:.1f}"])
    cont, paged = results
    lines = [
        "paging: " + __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
        "",
        f"Model: {label}. KV cache: {num_blocks} blocks of {block_size} tokens in both modes "
        f"({num_blocks * block_size * cont.kv_bytes_per_token / 2**20:.0f} MiB; contiguous fits "
        f"{num_blocks * block_size // cfg['max_model_len']} sequences at max_model_len={cfg['max_model_len']}). "
        f"Workload: {cfg['num_requests']} requests, prompts U{list(cfg['prompt'])}, outputs U{list(cfg['output'])} "
        "tokens, greedy",
        render_table(
            ["mode", "reserved MiB", "used MiB", "utilization", "waste", "waste slots/seq", "per-request util",
             "peak seqs", "mean seqs", "out tokens", "seconds", "out tok/s"],
            rows,
        ),
        "(reserved/used: KV bytes held vs holding a token, averaged over engine steps; per-request util: "
        "RequestOutput.metrics.kv_utilization at each request's last step)",
        f"paged vs contiguous: x{paged.stats['peak_running_seqs'] / max(cont.stats['peak_running_seqs'], 1):.1f} peak "
        f"concurrent sequences (target >= {TARGET_CONCURRENCY:g}x), x{paged.tokens_per_s / cont.tokens_per_s:.2f} output "
        f"tok/s (target >= {TARGET_THROUGHPUT:g}x); greedy outputs identical: {paged.outputs == cont.outputs}",
        "paper's numbers (Kwon et al., PagedAttention, SOSP 2023), for comparison only: existing systems used "
        "20.4-38.2% of their KV memory for token states; vLLM wastes under 4%.",
    ]
    return "\n".join(lines)


def plot(ax: Any, results: list[ModeResult]) -> None:
    names = [r.mode for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [100 * r.stats["kv_mean_utilization"] for r in results], 0.4, label="KV utilization %")
    ax2 = ax.twinx()
    ax2.bar([i + 0.2 for i in x], [r.tokens_per_s for r in results], 0.4, color="tab:orange", label="output tok/s")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names)
    ax.set_ylabel("KV utilization (%)")
    ax2.set_ylabel("output tokens/s")
    ax.set_title("paging vs contiguous reservation, equal KV memory")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")


def lesson_config(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the workload's config, the engine's KV options) for --quick / --num-requests / --max-model-len."""
    cfg = dict(QUICK if args.quick else FULL)
    if args.num_requests is not None:
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be a positive integer, got {args.num_requests}")
        cfg["num_requests"] = args.num_requests
    if args.max_model_len is not None:
        if args.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
        cfg["max_model_len"] = args.max_model_len
    block_size = 16
    num_blocks = cfg["contiguous_seqs"] * -(-cfg["max_model_len"] // block_size)
    longest = cfg["prompt"][1] + cfg["output"][1]
    if longest > cfg["max_model_len"]:
        cfg["prompt"] = (min(cfg["prompt"][0], cfg["max_model_len"] // 4), cfg["max_model_len"] // 2)
        cfg["output"] = (min(cfg["output"][0], cfg["max_model_len"] // 4), cfg["max_model_len"] // 2 - 1)
    engine_kwargs = dict(block_size=block_size, num_kv_blocks=num_blocks, max_model_len=cfg["max_model_len"],
                         max_num_seqs=64, max_num_batched_tokens=1024, enable_prefix_caching=False)
    return cfg, engine_kwargs


def run(args: Any) -> int:
    from kvforge.learn.common import make_engine, model_label, save_plot

    cfg, engine_kwargs = lesson_config(args)
    engine = make_engine(args.model, args.dtype, args.threads, **engine_kwargs)
    prompts, out_lens = workload(cfg, engine.model_config.vocab_size)
    results = [run_mode(engine, mode, prompts, out_lens) for mode in ("contiguous", "paged")]
    print(render(results, cfg, engine_kwargs["num_kv_blocks"], engine_kwargs["block_size"],
                 model_label(engine, args.model)))
    if args.plot:
        save_plot(args.plot, lambda ax: plot(ax, results))
        print(f"plot saved to {args.plot}")
    return 0
