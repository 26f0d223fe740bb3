"""`kvforge learn quant-at-length`: does KV-quantization error build up with context length?

A common warning: quantization error in the KV cache accumulates over long contexts, so sensitive
models should keep K in 16 bit and quantize only V, or use per-head scales. Every new token attends
over all the quantized keys before it: the longer the context, the more rounded scores enter each
softmax. K is the sensitive side because its rounding moves the attention weights themselves (the
error passes through exp), while V's rounding is only averaged.

The lesson scores one window of real text (CPython's documentation) through the paged cache once per
KV format, in prefill chunks, so every token reads all earlier K/V back from the quantized pool, as a
served long prompt does. The perplexity at context L is that of the window's first L tokens, so one
pass per format gives every length (the same numbers `kvforge eval kv-quant --contexts` gives for one
window). It prints the perplexity increase over the unquantized cache at each length, and the increase
on the last span of the window alone (the tokens that see the longest context), for per-head fp8 and
int8 stored plain and with the calibrated Hadamard rotation (kvforge's default, kv/rotation.py), and K 16-bit /
V fp8.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvforge.learn.common import render_table

CONTEXTS = (512, 1024, 2048, 4096, 8192)
QUICK_CONTEXTS = (256, 512, 1024, 2048)
# K/V format rows (the ledger's grammar): per-head fp8 stored plain (the default before the rotation) and
# with the calibrated rotation (the default storage now), the K-16-bit recipe, and int8 plain and calibrated
FORMATS = ("fp8_e4m3@head:none", "fp8_e4m3@head", "bfloat16/fp8_e4m3@head:none", "int8:none", "int8")
CHUNK = 1024  # tokens per scoring pass: later chunks read the earlier ones back from the quantized cache


@dataclass
class FormatRow:
    spec: str
    bytes_per_token: float
    perplexity: dict[int, float] = field(default_factory=dict)  # context -> ppl of the window's first tokens
    tail: float = 0.0  # perplexity of the last quarter of the longest context


def measure(engine: Any, contexts: tuple[int, ...], formats: tuple[str, ...]) -> list[FormatRow]:
    """The unquantized reference ("auto"), then each format: one window of max(contexts) tokens each."""
    from kvforge.evaluation.kv_quant import Variant, corpus_windows
    from kvforge.evaluation.long_context import score_window
    from kvforge.ledger import kv_bytes_per_token

    longest = max(contexts)
    if longest > engine.scheduler_config.max_model_len:
        raise ValueError(f"--contexts: {longest} exceeds the model's max_model_len "
                         f"{engine.scheduler_config.max_model_len}")
    (tokens,) = corpus_windows(engine.tokenizer, longest, 1)
    rows = []
    for spec in ("auto", *formats):
        engine.reconfigure_kv_cache(**Variant.parse(spec).engine_changes())
        nll = score_window(engine, tokens, CHUNK, kl_rows=1).nll  # [longest - 1] per-position NLL
        row = FormatRow(spec, kv_bytes_per_token(engine.model_config.kv_shape(), engine.cache_format,
                                                  engine.kv.block_size))
        row.perplexity = {c: math.exp(float(nll[: c - 1].mean())) for c in contexts}
        row.tail = math.exp(float(nll[(longest - 1) * 3 // 4 :].mean()))
        rows.append(row)
    engine.reconfigure_kv_cache(**Variant.parse("auto").engine_changes())
    return rows


def increase(row: FormatRow, base: FormatRow, context: int) -> float:
    """Perplexity increase over the unquantized cache at `context`, in percent."""
    return 100 * (row.perplexity[context] / base.perplexity[context] - 1)


def verdicts(rows: list[FormatRow]) -> list[str]:
    """What the table says about the claim, in words computed from the numbers (never assumed)."""
    base, rest = rows[0], {r.spec: r for r in rows[1:]}
    first, last = min(base.perplexity), max(base.perplexity)
    out = []
    for r in rows[1:]:
        a, b = increase(r, base, first), increase(r, base, last)
        trend = "grows" if abs(b) > abs(a) + 0.05 else ("shrinks" if abs(b) < abs(a) - 0.05 else "stays flat")
        out.append(f"{r.spec}: {a:+.2f}% at {first} -> {b:+.2f}% at {last} tokens: the loss {trend} with length")
    fp8 = [r for s, r in rest.items() if s.startswith("fp8_e4m3@")]
    split = next((r for s, r in rest.items() if s.startswith(("bfloat16/", "float16/", "auto/"))), None)
    if fp8 and split is not None:
        worst = max(abs(increase(r, base, last)) for r in fp8)
        mine = abs(increase(split, base, last))
        out.append(f"K in 16 bit ({split.spec}) at {last} tokens: {mine:.2f}% against {worst:.2f}% for all-fp8: "
                   + ("the remedy holds here" if mine < worst / 2 else "the remedy does not show on this run"))
    if "fp8_e4m3@token" in rest and "fp8_e4m3@head" in rest:
        tok, head = (abs(increase(rest[s], base, last)) for s in ("fp8_e4m3@token", "fp8_e4m3@head"))
        out.append(f"per-head fp8 scales at {last} tokens: {head:.2f}% against {tok:.2f}% per token: "
                   + ("per-head scales help" if head < tok else "per-head scales do not help here"))
    for spec, plain in rest.items():  # each format measured both ways: stored plain (":none") and rotated
        rotated = rest.get(spec[: -len(":none")]) if spec.endswith(":none") else None
        if rotated is not None:
            a, b = abs(increase(rotated, base, last)), abs(increase(plain, base, last))
            out.append(f"calibrated Hadamard rotation ({rotated.spec}) at {last} tokens: {a:.2f}% against {b:.2f}% "
                       "stored plain: " + ("the rotation helps" if a < b else "the rotation does not help here"))
    return out


def render(rows: list[FormatRow], label: str) -> str:
    base, contexts = rows[0], sorted(rows[0].perplexity)
    table = render_table(
        ["KV cache (K/V@scales)", "bytes/token", *[f"ppl@{c}" for c in contexts[-1:]],
         *[f"+% @{c}" for c in contexts], "+% last quarter"],
        [[("unquantized" if r.spec == "auto" else r.spec), f"{r.bytes_per_token:.0f}",
          f"{r.perplexity[contexts[-1]]:.4f}",
          *(("-" if r is base else f"{increase(r, base, c):+.2f}") for c in contexts),
          "-" if r is base else f"{100 * (r.tail / base.tail - 1):+.2f}"] for r in rows])
    lines = ["quant-at-length: " + __doc__.split("\n\n", 1)[1].split("\n\n")[0].replace("\n", " "), "",
             f"Model: {label}. One window of CPython's documentation, scored in {CHUNK}-token chunks through the cache.",
             table, "", *verdicts(rows),
             "(one window of one text: differences under ~0.1% are noise; measure longer with "
             "`kvforge eval kv-quant --contexts ...`; recorded figures in docs/kv-quantization-at-length.md)"]
    return "\n".join(lines)


def plot(ax: Any, rows: list[FormatRow]) -> None:
    base, contexts = rows[0], sorted(rows[0].perplexity)
    for r in rows[1:]:
        ax.plot(contexts, [increase(r, base, c) for c in contexts], "o-", label=r.spec)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity increase over the unquantized cache (%)")
    ax.set_title("quant-at-length: KV-quantization loss as the context grows")
    ax.legend(fontsize=8)


def run(args: Any) -> int:
    from kvforge.learn.common import make_engine, model_label, save_plot
    from kvforge.ledger import parse_kv_format

    contexts = tuple(sorted(args.contexts)) if args.contexts else (QUICK_CONTEXTS if args.quick else CONTEXTS)
    formats = tuple(s.strip() for s in args.formats.split(",") if s.strip()) if args.formats else FORMATS
    for spec in formats:
        parse_kv_format(spec, "--formats item")  # a bad format fails before the model loads
    if min(contexts) < 2:
        raise ValueError("--contexts: each context needs at least 2 tokens")
    longest = max(contexts)
    engine = make_engine(args.model, args.dtype, args.threads, enable_prefix_caching=False, block_size=16,
                         num_kv_blocks=-(-longest // 16) + 2, max_num_seqs=1)
    rows = measure(engine, contexts, formats)
    print(render(rows, model_label(engine, args.model)))
    if args.plot:
        save_plot(args.plot, lambda ax: plot(ax, rows))
        print(f"plot saved to {args.plot}")
    return 0
