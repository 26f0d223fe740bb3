"""`kvforge eval SUBCOMMAND`: quality measurements. `kvforge eval kv-quant` compares KV-cache formats.

Example:
  kvforge eval kv-quant                                   # default model, every format, full run
  kvforge eval kv-quant --formats fp8_e4m3,int8@channel,auto/int4 --num-prompts 5 --plot kv.png
"""
from __future__ import annotations

import argparse
import json
import sys

from kvforge.config import SUPPORTED_DTYPES


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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="quality evaluations (kv-quant: KV-cache quantization)")
    evsub = p.add_subparsers(dest="eval_command", metavar="EVAL")
    evsub.required = True
    kv = evsub.add_parser(
        "kv-quant", help="perplexity, KL and greedy agreement of each KV-cache format vs the unquantized cache",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kv.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    kv.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES, help="model (and reference cache) dtype")
    kv.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--formats", default=None,
                    help="comma-separated KDTYPE[/VDTYPE][@SCALE] rows, e.g. fp8_e4m3,int8@channel,auto/int4 "
                         "(default: every dtype and scale choice); the unquantized reference is always first")
    kv.add_argument("--contexts", type=_int_list("--contexts"), default=(256, 1024, 2048),
                    help="perplexity context lengths (default 256,1024,2048)")
    kv.add_argument("--windows", type=int, default=1, help="text windows scored per context length")
    kv.add_argument("--num-prompts", type=int, default=20, help="greedy prompts (one documentation topic each)")
    kv.add_argument("--prompt-tokens", type=int, default=32, help="tokens per greedy prompt")
    kv.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    kv.add_argument("--kv-cache-memory", default="1GiB", help="KV memory the capacity columns are priced at")
    kv.add_argument("--capacity-seq-len", type=int, default=2048, help="sequence length of the concurrency column")
    kv.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    kv.add_argument("--plot", default=None, metavar="PNG", help="also save a plot (KL vs bytes, agreement)")
    kv.set_defaults(func=run_kv_quant)
    ev = evsub.add_parser(
        "kv-evict", help="perplexity, greedy agreement and passkey retrieval of each KV eviction policy and budget",
        description="Quality of KV eviction (streaming, h2o, snapkv) per budget against the full cache, on CPython's "
                    "documentation. Example: kvforge eval kv-evict --quick --plot evict.png",
    )
    ev.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ev.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    ev.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    ev.add_argument("--block-size", type=int, default=16)
    ev.add_argument("--policies", default="streaming,h2o,snapkv", help="comma list of streaming, h2o, snapkv")
    ev.add_argument("--budgets", default="10%,20%,40%,60%,128,256",
                    help="comma list: N%% of each prompt (and of the streamed text) or N tokens")
    ev.add_argument("--ppl-tokens", type=int, default=2048, help="tokens of text streamed for perplexity")
    ev.add_argument("--stream-chunk", type=int, default=64, help="tokens fed between cuts while streaming")
    ev.add_argument("--num-prompts", type=int, default=4, help="prompts for step agreement and same prefix")
    ev.add_argument("--prompt-tokens", type=int, default=1536, help="tokens per prompt")
    ev.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens per prompt")
    ev.add_argument("--passkey-prompts", type=int, default=6)
    ev.add_argument("--passkey-tokens", type=int, default=1100)
    ev.add_argument("--quick", action="store_true",
                    help="a small run for a loaded machine: 1024 streamed tokens, 2 prompts x 1024 tokens, 32 generated")
    ev.add_argument("--kv-sink-tokens", type=int, default=4)
    ev.add_argument("--kv-recent-tokens", type=int, default=32)
    ev.add_argument("--snapkv-window", type=int, default=8)
    ev.add_argument("--snapkv-pool", type=int, default=7)
    ev.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ev.add_argument("--plot", default=None, metavar="PNG", help="also save a plot (perplexity, agreement, passkey)")
    ev.set_defaults(func=run_kv_evict)


def run(args: argparse.Namespace) -> int:  # the dispatcher's contract; the subcommand sets func itself
    return run_kv_quant(args)


def _engine_for_eval(args: argparse.Namespace, opts) -> object:  # type: ignore[no-untyped-def]
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine

    bs = args.block_size
    tokens = max(max(opts.contexts), opts.num_prompts * (opts.prompt_tokens + opts.gen_tokens + bs))
    blocks = -(-tokens // bs) + opts.num_prompts + 1
    return LLMEngine(EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, block_size=bs, num_kv_blocks=blocks,
        max_num_seqs=opts.num_prompts, max_num_batched_tokens=2048, log_ledger=False,
    ))


def run_kv_quant(args: argparse.Namespace) -> int:
    from kvforge.evaluation.kv_quant import DEFAULT_VARIANTS, EvalOptions, Variant, run_kv_quant_eval
    from kvforge.evaluation.kv_quant_report import concurrency_summary, render_table, save_plot
    from kvforge.ledger import parse_bytes

    specs = [s for s in (args.formats.split(",") if args.formats else DEFAULT_VARIANTS) if s.strip()]
    variants = [Variant.parse(s) for s in specs]
    opts = EvalOptions(
        contexts=tuple(args.contexts), windows=args.windows, num_prompts=args.num_prompts,
        prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
        capacity_memory=parse_bytes(args.kv_cache_memory, "--kv-cache-memory"), capacity_seq_len=args.capacity_seq_len,
    )
    if args.block_size < 1:
        raise ValueError(f"--block-size must be a positive integer, got {args.block_size}")
    engine = _engine_for_eval(args, opts)

    def progress(row) -> None:  # type: ignore[no-untyped-def]
        print(f"  measured {row.spec}", file=sys.stderr, flush=True)

    rows = run_kv_quant_eval(engine, variants, opts, progress)
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


def run_kv_evict(args: argparse.Namespace) -> int:
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine
    from kvforge.evaluation.kv_evict import EvictOptions, render_table, run_kv_evict_eval, save_plot

    quick = dict(ppl_tokens=1024, num_prompts=2, prompt_tokens=1024, gen_tokens=32) if args.quick else {}
    values = dict(ppl_tokens=args.ppl_tokens, stream_chunk=args.stream_chunk, num_prompts=args.num_prompts,
                  prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                  passkey_prompts=args.passkey_prompts, passkey_tokens=args.passkey_tokens)
    values.update(quick)
    opts = EvictOptions(policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
                        budgets=tuple(b.strip() for b in args.budgets.split(",") if b.strip()), **values)
    engine = LLMEngine(EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_num_batched_tokens=2048, max_num_seqs=16, log_ledger=False, kv_sink_tokens=args.kv_sink_tokens,
        kv_recent_tokens=args.kv_recent_tokens, snapkv_window=args.snapkv_window, snapkv_pool=args.snapkv_pool,
    ))

    def progress(row) -> None:  # type: ignore[no-untyped-def]
        print(f"  measured {row.policy} @ {row.budget}", file=sys.stderr, flush=True)

    rows = run_kv_evict_eval(engine, opts, progress)
    model = args.model or "SmolLM2-135M-Instruct (default)"
    if args.json:
        print(json.dumps({"model": model, "options": vars(opts), "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(render_table(rows, opts, model))
    if args.plot:
        save_plot(rows, args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)
    return 0
