"""`kvforge learn DEMO`, shared by its four commands (`learn_*.py`): the KV cache's lessons, measured here.

  kvforge learn why-cache            # time per token with the cache vs recomputing the prefix, 64..2048
  kvforge learn prefill-vs-decode    # tokens/s, FLOPs per byte, and this machine's compute peak and bandwidth
  kvforge learn paging               # contiguous max_model_len reservation vs paged blocks in equal memory
  kvforge learn quant-at-length      # KV-quantization loss against context length: fp8, K 16-bit / V fp8, int8
Each takes --quick (a smaller run, under a minute) and --plot FILE.PNG (needs matplotlib).
Each demo is its own command in the registry (group "learn"); this module holds their flags and runner.
"""
from __future__ import annotations

import argparse
import importlib

from kvforge.config import SUPPORTED_DTYPES



def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_demo_arguments(d: argparse.ArgumentParser, name: str) -> None:
    """The flags of `kvforge learn NAME`: the common ones, then the demo's own."""
    d.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    d.add_argument("--dtype", default="auto", choices=("auto", *SUPPORTED_DTYPES),
                   help="model dtype (auto: resolved at load, as for the engine)")
    d.add_argument("--quick", action="store_true", help="a smaller run (under a minute)")
    d.add_argument("--plot", default=None, metavar="PNG", help="also save a plot (needs matplotlib)")
    d.add_argument("--cpu-time", action="store_true",
                   help="time in this process's CPU seconds, not wall seconds (a loaded, shared machine)")
    d.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 measures steadily on a loaded, shared machine")
    if name in ("why-cache", "quant-at-length"):
        d.add_argument("--contexts", type=_int_list, default=None, help="context lengths, e.g. 64,512,2048")
    if name == "quant-at-length":
        d.add_argument("--formats", default=None, help="comma-separated KDTYPE[/VDTYPE][@SCALE] rows (default: "
                       "fp8_e4m3@token,fp8_e4m3@head,bfloat16/fp8_e4m3@head,int8)")
    if name == "prefill-vs-decode":
        d.add_argument("--batches", type=_int_list, default=None, help="batch sizes (default 1,32)")
        d.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence")
    if name == "paging":
        d.add_argument("--num-requests", type=int, default=None, help="requests in the workload")
        d.add_argument("--max-model-len", type=int, default=None, help="what contiguous mode reserves per sequence")
        d.add_argument("--serve", action="store_true",
                       help="run the workload through a server and watch it at /kv (contiguous, then paged, in rounds)")
        d.add_argument("--port", type=int, default=8000, help="--serve: the server's port (0: any free port)")
        d.add_argument("--rounds", type=int, default=None, help="--serve: rounds of both modes (default: until Ctrl-C; "
                       "--quick: 1)")
        d.add_argument("--pause", type=float, default=5.0, help="--serve: seconds to look between the modes")


def run_demo(module_name: str, args: argparse.Namespace) -> int:
    """Run `module_name`.run(args) (torch is imported there, only now), restoring threads and clock after."""
    import torch

    from kvforge.learn.common import use_cpu_clock

    module = importlib.import_module(module_name)
    threads = torch.get_num_threads()
    use_cpu_clock(args.cpu_time)
    try:
        return int(module.run(args) or 0)
    finally:  # a caller in the same process (tests, notebooks) keeps its own settings
        use_cpu_clock(False)
        torch.set_num_threads(threads)
