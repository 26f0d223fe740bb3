"""`kvforge eval kv-evict`: perplexity, greedy agreement and passkey retrieval of each KV eviction policy and budget.

Quality of KV eviction (streaming, h2o, snapkv) per budget against the full cache, on CPython's documentation.

With kvpress available (`--kvpress-python VENV/bin/python`, or kvpress importable here), kvpress's
presses run on transformers with the same weights, prompts and budgets, and print beside kvforge's rows
(passkey and teacher-forced step agreement). The venv recipe is in kvforge/evaluation/kvpress_referee.py.

Example:
  kvforge eval kv-evict --quick --plot evict.png
  kvforge eval kv-evict --quick --policies none --budgets 128,256 --kvpress-python ~/kvpress-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import sys

from kvforge.config import SUPPORTED_DTYPES, CacheConfig
from kvforge.flags import add_dataclass_flags, default_of, flag_errors, flags_of, values_for
from kvforge.kv.eviction import EvictionConfig

HELP = "quality cost of each KV eviction policy and budget (perplexity, agreement, passkey)"
_KNOBS = ("kv_eviction", "kv_budget")  # chosen per row by --policies and --budgets; the policies' knobs are flags


def add_arguments(ev: argparse.ArgumentParser) -> None:
    ev.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ev.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    ev.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    ev.add_argument("--block-size", type=int, default=default_of(CacheConfig, "block_size"), help="tokens per KV block")
    ev.add_argument("--policies", default="streaming,h2o,snapkv",
                    help="comma list of streaming, h2o, snapkv; none: only the full cache (and the kvpress referee)")
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
    add_dataclass_flags(ev, EvictionConfig, exclude=_KNOBS)
    ev.add_argument("--kvpress-python", default=None, metavar="PYTHON",
                    help="interpreter of a venv with kvpress (the referee); default: this one if it imports kvpress")
    ev.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ev.add_argument("--plot", default=None, metavar="PNG", help="also save a plot (perplexity, agreement, passkey)")


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine
    from kvforge.evaluation.kv_evict import EvictOptions, render_table, run_kv_evict_eval, save_plot
    from kvforge.evaluation.kv_evict_referee import ENABLE_HINT, find_python, kvpress_rows

    quick = dict(ppl_tokens=1024, num_prompts=2, prompt_tokens=1024, gen_tokens=32) if args.quick else {}
    values = dict(ppl_tokens=args.ppl_tokens, stream_chunk=args.stream_chunk, num_prompts=args.num_prompts,
                  prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                  passkey_prompts=args.passkey_prompts, passkey_tokens=args.passkey_tokens)
    values.update(quick)
    kvpress_python = find_python(args.kvpress_python)  # a bad --kvpress-python fails before the model loads
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "none")
    opts = EvictOptions(policies=policies,
                        budgets=tuple(b.strip() for b in args.budgets.split(",") if b.strip()), **values)
    knobs = {k: v for k, v in values_for(EvictionConfig, args).items() if k not in _KNOBS}
    with flag_errors({**flags_of(EvictionConfig), "block_size": "--block-size", "dtype": "--dtype",
                      "device": "--device", "model": "--model"}):
        config = EngineArgs(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                            max_num_batched_tokens=2048, max_num_seqs=16, log_ledger=False, **knobs)
    engine = LLMEngine(config)

    def progress(row) -> None:  # type: ignore[no-untyped-def]
        print(f"  measured {row.policy} @ {row.budget}", file=sys.stderr, flush=True)

    referee, failed = None, []
    if kvpress_python is None:
        print(f"kvpress referee skipped: kvpress is not importable here; {ENABLE_HINT}", file=sys.stderr)
    else:
        def referee(ev) -> list:  # type: ignore[no-untyped-def]
            try:
                return kvpress_rows(ev, args.model, kvpress_python, progress)
            except RuntimeError as exc:  # kvforge's rows are still printed; the exit code says it failed
                failed.append(str(exc))
                return []
    rows = run_kv_evict_eval(engine, opts, progress, referee)
    model = args.model or "SmolLM2-135M-Instruct (default)"
    if args.json:
        print(json.dumps({"model": model, "options": vars(opts), "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(render_table(rows, opts, model))
    if args.plot:
        save_plot(rows, args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)
    for why in failed:
        print(f"kvforge eval kv-evict: error: {why}; its rows are missing", file=sys.stderr)
    return 1 if failed else 0
