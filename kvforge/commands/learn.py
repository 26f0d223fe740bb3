"""`kvforge learn DEMO`: the KV cache's lessons, measured on this machine and model.

  kvforge learn why-cache            # time per token with the cache vs recomputing the prefix, 64..2048
  kvforge learn prefill-vs-decode    # tokens/s, FLOPs per byte, and this machine's compute peak and bandwidth
  kvforge learn paging               # contiguous max_model_len reservation vs paged blocks in equal memory
Each takes --quick (a smaller run, under a minute) and --plot FILE.PNG (needs matplotlib).
"""
from __future__ import annotations

import argparse
import importlib

from kvforge.config import SUPPORTED_DTYPES

DEMOS = {  # demo -> (module with run(args), help)
    "why-cache": ("kvforge.learn.why_cache", "the cost of no KV cache: per-token time and FLOPs vs context"),
    "prefill-vs-decode": ("kvforge.learn.prefill_decode", "prefill is compute-bound, decode memory-bound"),
    "paging": ("kvforge.learn.paging", "paged blocks vs contiguous reservation: utilization, concurrency, tok/s"),
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("learn", help="runnable, measured lessons: why-cache, prefill-vs-decode, paging",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demos = p.add_subparsers(dest="demo", metavar="DEMO")
    demos.required = True
    for name, (_, help_text) in DEMOS.items():
        d = demos.add_parser(name, help=help_text, description=help_text)
        d.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
        d.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
        d.add_argument("--quick", action="store_true", help="a smaller run (under a minute)")
        d.add_argument("--plot", default=None, metavar="PNG", help="also save a plot (needs matplotlib)")
        d.add_argument("--cpu-time", action="store_true",
                       help="time in this process's CPU seconds, not wall seconds (a loaded, shared machine)")
        d.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads (default: torch's); 1 measures steadily on a loaded, shared machine")
        if name == "why-cache":
            d.add_argument("--contexts", type=_int_list, default=None, help="context lengths, e.g. 64,512,2048")
        if name == "prefill-vs-decode":
            d.add_argument("--batches", type=_int_list, default=None, help="batch sizes (default 1,32)")
            d.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence")
        if name == "paging":
            d.add_argument("--num-requests", type=int, default=None, help="requests in the workload")
            d.add_argument("--max-model-len", type=int, default=None, help="what contiguous mode reserves per sequence")
        d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvforge.learn.common import use_cpu_clock

    module = importlib.import_module(DEMOS[args.demo][0])  # torch is imported there, only now
    threads = torch.get_num_threads()
    use_cpu_clock(args.cpu_time)
    try:
        return int(module.run(args) or 0)
    finally:  # a caller in the same process (tests, notebooks) keeps its own settings
        use_cpu_clock(False)
        torch.set_num_threads(threads)
