"""`kvforge eval kv-quant`: perplexity, KL and greedy agreement of each KV-cache format vs the unquantized cache.

The default run measures 16 rows (the unquantized reference + 15 formats, two of
them fp8 and int8 stored without the default Hadamard rotation), each over 3
perplexity contexts and 20 greedy prompts: about 10 minutes on a 2-core CPU with
the default model. A bar with an ETA shows progress on a terminal.

Example:
  kvforge eval kv-quant                                   # default model, every format, full run
  kvforge eval kv-quant --formats fp8_e4m3,int8@channel,auto/int4 --num-prompts 5 --plot kv.png
"""
from __future__ import annotations

import argparse
import json
import sys

from kvforge.progress import progress_bar
from kvforge.config import SUPPORTED_DTYPES, CacheConfig
from kvforge.flags import default_of, flag_errors


def _int_list(flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects comma-separated integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag} needs at least one value")
        return values

    return parse


HELP = "quality cost of each KV-cache format (perplexity, KL, greedy agreement)"
DEFAULT_ROWS = 16  # the reference + the 15 quantized DEFAULT_VARIANTS; a test keeps this true

# EvalOptions field -> the flag that sets it (error messages name the flag)
EVAL_FLAGS = {
    "contexts": "--contexts", "windows": "--windows", "num_prompts": "--num-prompts",
    "prompt_tokens": "--prompt-tokens", "gen_tokens": "--gen-tokens", "capacity_memory": "--kv-cache-memory",
    "capacity_seq_len": "--capacity-seq-len", "block_size": "--block-size", "dtype": "--dtype",
    "device": "--device", "model": "--model", "prefill_chunk": "--prefill-chunk",
}


def add_arguments(kv: argparse.ArgumentParser) -> None:
    kv.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    kv.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES, help="model (and reference cache) dtype")
    kv.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    kv.add_argument("--block-size", type=int, default=default_of(CacheConfig, "block_size"), help="tokens per KV block")
    kv.add_argument("--formats", default=None,
                    help="comma-separated KDTYPE[/VDTYPE][@SCALE] rows, e.g. fp8_e4m3,int8@channel,auto/int4 "
                         f"(default: every dtype and scale choice, {DEFAULT_ROWS} rows); the unquantized reference "
                         "is always first")
    kv.add_argument("--contexts", type=_int_list("--contexts"), default=(256, 1024, 2048),
                    help="perplexity context lengths, e.g. 2048,8192,32768 (each at most the model's max_model_len)")
    kv.add_argument("--prefill-chunk", type=int, default=None,
                    help="tokens per scoring pass (default 2048): a long window is prefilled in chunks through the "
                         "(quantized) cache, so memory stays bounded at any context")
    kv.add_argument("--windows", type=int, default=1, help="text windows scored per context length")
    kv.add_argument("--num-prompts", type=int, default=20, help="greedy prompts (one documentation topic each)")
    kv.add_argument("--prompt-tokens", type=int, default=32, help="tokens per greedy prompt")
    kv.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    kv.add_argument("--kv-cache-memory", default="1GiB", help="KV memory the capacity columns are priced at")
    kv.add_argument("--capacity-seq-len", type=int, default=2048, help="sequence length of the concurrency column")
    kv.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    kv.add_argument("--plot", default=None, metavar="PNG", help="also save a plot (KL vs bytes, agreement)")


def _engine_for_eval(args: argparse.Namespace, opts) -> object:  # type: ignore[no-untyped-def]
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine

    bs = args.block_size
    tokens = max(max(opts.contexts), opts.num_prompts * (opts.prompt_tokens + opts.gen_tokens + bs))
    blocks = -(-tokens // bs) + opts.num_prompts + 1
    with flag_errors(EVAL_FLAGS):
        config = EngineArgs(
            model=args.model, dtype=args.dtype, device=args.device, block_size=bs, num_kv_blocks=blocks,
            max_num_seqs=opts.num_prompts, max_num_batched_tokens=2048, log_ledger=False,
        )
    return LLMEngine(config)


def run(args: argparse.Namespace) -> int:
    from kvforge.evaluation.kv_quant import (
        DEFAULT_VARIANTS, EvalOptions, Variant, measured_variants, measurement_count, run_kv_quant_eval,
    )
    from kvforge.evaluation.kv_quant_report import concurrency_summary, render_table, save_plot
    from kvforge.ledger import parse_bytes

    specs = [s for s in (args.formats.split(",") if args.formats else DEFAULT_VARIANTS) if s.strip()]
    variants = [Variant.parse(s) for s in specs]
    with flag_errors(EVAL_FLAGS):
        CacheConfig(block_size=args.block_size)  # validated before it sizes the pool
        opts = EvalOptions(
            contexts=tuple(args.contexts), windows=args.windows, num_prompts=args.num_prompts,
            prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
            capacity_memory=parse_bytes(args.kv_cache_memory, "--kv-cache-memory"),
            capacity_seq_len=args.capacity_seq_len,
            **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}),
        )
    engine = _engine_for_eval(args, opts)
    rows_to_measure = measured_variants(variants)
    bar = progress_bar(measurement_count(len(rows_to_measure), opts), "kv-quant")

    def row_done(row) -> None:  # type: ignore[no-untyped-def]
        bar.write(f"  measured {row.spec}")

    try:
        with flag_errors(EVAL_FLAGS):
            rows = run_kv_quant_eval(engine, variants, opts, row_done, on_measure=bar.update)
    finally:
        bar.close()
    model = args.model or "SmolLM2-135M-Instruct (default)"
    if args.json:
        print(json.dumps({"model": model, "options": {**vars(opts), "contexts": list(opts.contexts)},
                          "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(render_table(rows, opts, model))
        print(concurrency_summary(rows, opts))
    if args.plot:
        save_plot(rows, args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)
    return 0
