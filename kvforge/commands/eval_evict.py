"""`kvforge eval kv-evict`: perplexity, greedy agreement and passkey retrieval of each KV eviction policy and budget.

Quality of KV eviction (streaming, h2o, snapkv) per budget against the full cache, on CPython's documentation.

With kvpress available (`--kvpress-python VENV/bin/python`, or kvpress importable here), kvpress's
presses run on transformers with the same weights, prompts and budgets, and print beside kvforge's rows
(passkey and teacher-forced step agreement). The venv recipe is in kvforge/evaluation/kvpress_referee.py.

With --passkey-lengths (and --passkey-depths, --passkey-budgets) it measures passkey retrieval at depth
and length instead: keys at each depth of prompts of each length, for the full cache and each policy at
each budget (kvforge/evaluation/passkey_depth.py); --save PREFIX writes PREFIX.txt, .json and .png.
There the referee runs only when --kvpress-python names it (each press prefills every long prompt again in
transformers): kvpress SnapKV and StreamingLLM, and its token-level H2O up to 4K-token prompts.

Example:
  kvforge eval kv-evict --quick --plot evict.png
  kvforge eval kv-evict --passkey-lengths 4096,8184 --passkey-depths 10,30,50,70,90 --passkey-budgets 256,1024,10%
  kvforge eval kv-evict --quick --policies none --budgets 128,256 --kvpress-python ~/kvpress-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable

from kvforge.config import SUPPORTED_DTYPES, CacheConfig
from kvforge.flags import add_dataclass_flags, default_of, flag_errors, flags_of, values_for
from kvforge.kv.eviction import EvictionConfig

DEFAULT_DEPTHS = (10, 30, 50, 70, 90)
DEFAULT_LENGTHS = (4096, 8184)  # 8184 + 8 answer tokens fit the default model's 8192
DEFAULT_BUDGETS = ("256", "1024", "10%")


def parse_depths(text: str) -> tuple[int, ...]:
    """'10,30,50' (percent of the document before the key, each 0..100; a trailing % is allowed)."""
    items = [x.strip().rstrip("%") for x in text.split(",") if x.strip()]
    if not items or not all(re.fullmatch(r"\d+", x) for x in items):
        raise ValueError(f"--passkey-depths expects comma-separated percentages such as 10,50,90, got {text!r}")
    depths = tuple(int(x) for x in items)
    if max(depths) > 100:
        raise ValueError(f"--passkey-depths: each depth is a percentage from 0 to 100, got {text!r}")
    return depths


def parse_lengths(text: str) -> tuple[int, ...]:
    """'4096,8K,16k' (prompt tokens; K = 1024)."""
    lengths = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        m = re.fullmatch(r"(\d+)([kK]?)", x)
        if m is None:
            raise ValueError(f"--passkey-lengths expects comma-separated token counts such as 4096,8K, got {text!r}")
        lengths.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    if not lengths:
        raise ValueError("--passkey-lengths needs at least one length")
    if min(lengths) < 256:
        raise ValueError(f"--passkey-lengths: each prompt needs at least 256 tokens, got {text!r}")
    return tuple(lengths)


def parse_budgets(text: str) -> tuple[str, ...]:
    budgets = tuple(b.strip() for b in text.split(",") if b.strip())
    if not budgets or not all(re.fullmatch(r"\d+%?", b) and int(b.rstrip("%")) >= 1 for b in budgets):
        raise ValueError(f"--passkey-budgets expects N% of the prompt or N tokens, comma-separated, got {text!r}")
    return budgets


def _checked(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type: the parser's ValueError becomes a usage error (exit code 2, the flag named)."""
    def check(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


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
    ev.add_argument("--passkey-prompts", type=int, default=None,
                    help="passkey prompts (default 6); with --passkey-lengths, prompts per length and depth (default 2)")
    ev.add_argument("--passkey-tokens", type=int, default=1100)
    ev.add_argument("--quick", action="store_true",
                    help="a small run for a loaded machine: 1024 streamed tokens, 2 prompts x 1024 tokens, 32 generated")
    add_dataclass_flags(ev, EvictionConfig, exclude=_KNOBS)
    ev.add_argument("--kvpress-python", default=None, metavar="PYTHON",
                    help="interpreter of a venv with kvpress (the referee); default: this one if it imports kvpress "
                    "(with --passkey-lengths: only when given)")
    ev.add_argument("--passkey-lengths", type=_checked(parse_lengths), default=None, metavar="N,N",
                    help="passkey at depth and length: prompt lengths in tokens, e.g. 4096,8184,16K (each + 8 "
                         "answer tokens within max_model_len); runs this mode instead of the table above")
    ev.add_argument("--passkey-depths", type=_checked(parse_depths), default=None, metavar="P,P",
                    help="with --passkey-lengths: key depths in %% of the document (default 10,30,50,70,90)")
    ev.add_argument("--passkey-budgets", type=_checked(parse_budgets), default=None, metavar="B,B",
                    help="with --passkey-lengths: budgets, N tokens or N%% of the prompt (default 256,1024,10%%)")
    ev.add_argument("--save", default=None, metavar="PREFIX",
                    help="with --passkey-lengths: also write PREFIX.txt, PREFIX.json and PREFIX.png (matplotlib)")
    ev.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ev.add_argument("--plot", default=None, metavar="PNG", help="also save a plot (perplexity, agreement, passkey)")


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine
    from kvforge.evaluation.kv_evict import EvictOptions, render_table, run_kv_evict_eval, save_plot
    from kvforge.evaluation.kv_evict_referee import ENABLE_HINT, find_python, kvpress_rows

    if args.passkey_lengths or args.passkey_depths or args.passkey_budgets or args.save:
        return _run_depth(args)
    quick = dict(ppl_tokens=1024, num_prompts=2, prompt_tokens=1024, gen_tokens=32) if args.quick else {}
    values = dict(ppl_tokens=args.ppl_tokens, stream_chunk=args.stream_chunk, num_prompts=args.num_prompts,
                  prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                  passkey_prompts=6 if args.passkey_prompts is None else args.passkey_prompts, passkey_tokens=args.passkey_tokens)
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


def _run_depth(args: argparse.Namespace) -> int:
    """--passkey-lengths: keys at each depth of prompts of each length, full cache vs each policy and budget."""
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine
    from kvforge.evaluation.kv_evict_referee import find_python
    from kvforge.evaluation.passkey_depth import run_passkey_depth, save_depth_plot

    per_depth = 2 if args.passkey_prompts is None else args.passkey_prompts
    if per_depth < 1:
        print("kvforge eval kv-evict: error: --passkey-prompts must be a positive integer", file=sys.stderr)
        return 2
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "none")
    bad = [p for p in policies if p not in ("streaming", "h2o", "snapkv")]
    if bad:
        print(f"kvforge eval kv-evict: error: --policies item {bad[0]!r}: expected streaming, h2o, snapkv or none",
              file=sys.stderr)
        return 2
    try:
        kvpress_python = find_python(args.kvpress_python) if args.kvpress_python else None
    except ValueError as exc:
        print(f"kvforge eval kv-evict: error: {exc}", file=sys.stderr)
        return 2
    knobs = {k: v for k, v in values_for(EvictionConfig, args).items() if k not in _KNOBS}
    lengths, budgets = args.passkey_lengths or DEFAULT_LENGTHS, args.passkey_budgets or DEFAULT_BUDGETS
    # one prompt's budgets run together and share its prefill; room for two more prompts' prefixes to stay cached
    per_prompt = -(-(max(lengths) + 8) // args.block_size) + 1
    with flag_errors({**flags_of(EvictionConfig), "block_size": "--block-size", "dtype": "--dtype",
                      "device": "--device", "model": "--model"}):
        config = EngineArgs(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                            num_kv_blocks=per_prompt * (len(budgets) + 2), max_num_batched_tokens=2048,
                            max_num_seqs=16, log_ledger=False, **knobs)
    engine = LLMEngine(config)
    model = args.model or "SmolLM2-135M-Instruct (default)"
    try:
        result = run_passkey_depth(
            engine, args.passkey_depths or DEFAULT_DEPTHS, lengths, budgets, policies, per_depth,
            progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
            on_update=lambda partial: _save_depth(args.save, partial, model, args.dtype) if args.save else None)
    except ValueError as exc:  # a length the model cannot hold: named with its flag
        print(f"kvforge eval kv-evict: error: {exc}", file=sys.stderr)
        return 2
    failed = []
    if kvpress_python is not None:
        try:
            _depth_referee(args, engine, result, kvpress_python)
        except RuntimeError as exc:  # kvforge's rows are still printed; the exit code says it failed
            failed.append(str(exc))
    table, payload = _save_depth(args.save, result, model, args.dtype)
    print(json.dumps(payload, indent=2) if args.json else table)
    for png in filter(None, (args.plot, args.save and args.save + ".png")):
        try:
            save_depth_plot(result, png)
            print(f"plot saved to {png}", file=sys.stderr)
        except ImportError:
            print(f"plot {png} skipped: matplotlib is not installed", file=sys.stderr)
    for why in failed:
        print(f"kvforge eval kv-evict: error: {why}; its rows are missing", file=sys.stderr)
    return 1 if failed else 0


# ObservedAttention (H2O) needs eager attention, whose [heads, L, L] weights per layer outgrow memory past 4K
REFEREE_H2O_MAX_LEN = 4096


def _depth_referee(args: argparse.Namespace, engine, result, python: str) -> None:  # type: ignore[no-untyped-def]
    """kvpress's SnapKV and StreamingLLM (and its token-level H2O up to `REFEREE_H2O_MAX_LEN`) on the same
    prompts and budgets in transformers, added to `result` beside transformers' own full cache."""
    import tempfile

    from kvforge.evaluation.kv_evict import budget_tokens
    from kvforge.evaluation.kv_evict_referee import build_job, export_hf_folder, referee_threads, run_referee
    from kvforge.evaluation.passkey_depth import add_referee_cells, build_prompts

    prompts = build_prompts(engine.tokenizer, result.lengths, result.depths, result.per_depth)
    bs = engine.kv.block_size
    presses = ["kvpress SnapKV (w=64)", "kvpress StreamingLLM"]
    if max(result.lengths) <= REFEREE_H2O_MAX_LEN:
        presses.append("kvpress ObservedAttention (H2O)")
    budgets = [(b, [budget_tokens(b, p.length, bs) for p in prompts], []) for b in result.budgets]
    with tempfile.TemporaryDirectory(prefix="kvforge-kvpress-") as tmp:
        folder = export_hf_folder(args.model, tmp)
        job = build_job(folder, [p.ids for p in prompts], [], budgets, presses, threads=referee_threads())
        answers = run_referee(python, job, on_row=lambda a: print(
            f"  kvpress referee: {a['policy']} @ {a['budget']}" + (f" failed: {a['error']}" if a.get("error") else ""),
            file=sys.stderr, flush=True))
    add_referee_cells(result, prompts, answers, engine.tokenizer.decode, bs)


def _save_depth(prefix: str | None, result, model: str, dtype: str) -> tuple[str, dict]:  # type: ignore[no-untyped-def]
    """The table and JSON of `result`, written to PREFIX.txt / PREFIX.json (after every prompt: a long run
    stopped early keeps what it measured)."""
    from kvforge.evaluation.passkey_depth import render_depth_table

    table = render_depth_table(result, model)
    payload = {"model": model, "dtype": dtype, **result.to_dict()}
    if prefix:
        with open(prefix + ".txt", "w") as f:
            f.write(table + "\n")
        with open(prefix + ".json", "w") as f:
            json.dump(payload, f, indent=2)
    return table, payload
