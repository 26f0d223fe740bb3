"""Presenting `kvforge eval kv-quant` results: a text table, JSON, and an optional plot."""
from __future__ import annotations

from kvforge.evaluation.kv_quant import EvalOptions, RowResult
from kvforge.ledger import format_bytes

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}


def storage_label(row: RowResult) -> str:
    k, v = _SHORT.get(row.k_dtype, row.k_dtype), _SHORT.get(row.v_dtype, row.v_dtype)
    name = k if k == v else f"K {k} / V {v}"
    if row.scale is not None:
        scale = "K chan, V tok" if row.scale == "channel" else row.scale
        name += f" @{scale}, " + (row.rotation or "plain")  # auto: rotated where calibration measured it better
    return name


def increase(row: RowResult, ref: RowResult, context: int) -> float:
    """Perplexity increase over the reference at `context`, in percent."""
    return 100 * (row.perplexity[context] / ref.perplexity[context] - 1)


def _ppl_cell(row: RowResult, ref: RowResult, context: int) -> str:
    cell = f"{row.perplexity[context]:.3f}"
    return cell if row is ref else f"{cell} ({increase(row, ref, context):+.2f}%)"


def render_table(rows: list[RowResult], opts: EvalOptions, model: str) -> str:
    ref = rows[0]
    contexts = sorted(ref.perplexity)
    head = ["cache (K/V @scales)", "B/token"] + [f"ppl@{c}" for c in contexts] + [
        "KL vs ref", "step agree", "same prefix", f"seqs@{opts.capacity_seq_len}", "x ref"]
    body = []
    for r in rows:
        body.append([storage_label(r), format_bytes(r.bytes_per_token)]
                    + [_ppl_cell(r, ref, c) for c in contexts]
                    + [f"{r.kl:.5f}", f"{100 * r.step_agreement:.1f}%", f"{100 * r.same_prefix:.1f}%",
                       str(r.sequences), f"{r.blocks / ref.blocks:.2f}x"])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = [
        f"kvforge eval kv-quant: {model}; text = CPython pydoc topics; reference = first row (unquantized)",
        f"  ppl (+% vs ref): {opts.windows} window(s) per context, scored in {opts.prefill_chunk}-token prefill "
        f"chunks; KL: mean next-token KL(ref || row) over those positions; "
        f"greedy: {opts.num_prompts} prompts x {opts.gen_tokens} tokens",
        f"  capacity at {format_bytes(opts.capacity_memory)} of KV memory (ledger): "
        f"{ref.blocks} blocks for the reference; seqs = full {opts.capacity_seq_len}-token sequences at once",
        "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))),
    ]
    for b in body:
        lines.append("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def concurrency_summary(rows: list[RowResult], opts: EvalOptions) -> str:
    """One line per storage size class: concurrency at equal memory relative to a 16-bit cache."""
    half = next((r for r in rows if r.k_dtype == r.v_dtype == "bfloat16"), None)
    base = half or rows[0]
    parts = [f"{storage_label(r)}: {r.sequences} seqs ({r.blocks / base.blocks:.2f}x)" for r in rows]
    return (f"concurrency at {format_bytes(opts.capacity_memory)}, {opts.capacity_seq_len}-token sequences, "
            f"relative to {storage_label(base)}: " + "; ".join(parts))


def save_plot(rows: list[RowResult], path: str) -> None:
    """Quality (KL, log scale) against bytes per token, one labelled point per row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'kvforge[plot]')") from None

    contexts = sorted(rows[0].perplexity)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(19, 5))
    for r in rows[1:]:
        ax1.scatter(r.bytes_per_token / 1024, max(r.kl, 1e-7))
        ax1.annotate(storage_label(r), (r.bytes_per_token / 1024, max(r.kl, 1e-7)), fontsize=7)
    ax1.set_xlabel("KV bytes per token (KiB, all layers)")
    ax1.set_ylabel("mean next-token KL vs unquantized")
    ax1.set_yscale("log")
    labels = [storage_label(r) for r in rows]
    ax2.barh(labels, [100 * r.step_agreement for r in rows], color="tab:blue", label="step agreement")
    ax2.barh(labels, [100 * r.same_prefix for r in rows], color="tab:orange", alpha=0.6, label="same prefix")
    ax2.set_xlabel("greedy agreement with unquantized (%)")
    ax2.invert_yaxis()
    ax2.tick_params(axis="y", labelsize=7)
    ax2.legend(loc="lower left", fontsize=7)
    for r in rows[1:]:  # the seed's long-context claim: does the error grow with the context?
        ax3.plot(contexts, [increase(r, rows[0], c) for c in contexts], marker="o", label=storage_label(r))
    ax3.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax3.set_xscale("log", base=2)
    ax3.set_xticks(contexts, [str(c) for c in contexts])
    ax3.set_xlabel("context length (tokens)")
    ax3.set_ylabel("perplexity increase vs unquantized (%)")
    ax3.legend(fontsize=6, ncol=2)
    fig.suptitle("kvforge eval kv-quant")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
