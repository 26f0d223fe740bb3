"""`--plot out.png`: KV memory, and concurrency under the budget, against context length.

matplotlib is imported here only, and only when a plot is asked for, so `kvforge plan`
stays a pure-Python, instant command. Every point comes from `kvforge.ledger`.
"""
from __future__ import annotations

from kvforge import ledger
from kvforge.planner.capacity import Column, PlanOptions, concurrency


def context_lengths(longest: int) -> list[int]:
    """Powers of two from 256 up to (and including) the longest context of interest."""
    lengths, n = [], 256
    while n < longest:
        lengths.append(n)
        n *= 2
    return lengths + [max(longest, 256)]


def write_plot(path: str, cols: list[Column], opts: PlanOptions) -> None:
    """Draw one line per configuration; a second panel when a GPU budget was given."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'kvforge[plot]')") from None
    longest = max([opts.seq_len] + [c.capacity.max_model_len for c in cols if c.capacity])
    xs = context_lengths(longest)
    with_capacity = all(c.capacity is not None for c in cols)
    fig, axes = plt.subplots(1, 2 if with_capacity else 1, figsize=(12 if with_capacity else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for c in cols:
        gib = [ledger.kv_bytes_for_sequence(c.shape, n, c.fmt, opts.block_size) / 2**30 for n in xs]
        ax.plot(xs, gib, marker="o", markersize=3, label=c.label)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="KV cache (GiB)",
           title="KV cache of one sequence")
    ax.set_xscale("log", base=2)
    if with_capacity:
        ax2 = axes[0][1]
        for c in cols:
            assert c.capacity is not None
            conc = [concurrency(c, opts, c.capacity.kv_memory, n) for n in xs]
            ax2.plot(xs, [max(v, 0.5) for v in conc], marker="o", markersize=3, label=c.label)
        ax2.set(yscale="log", xlabel="context length (tokens)", ylabel="concurrent sequences",
                title=f"Sequences that fit in the KV pool ({ledger.format_bytes(opts.gpu_memory or 0)} GPU)")
        ax2.set_xscale("log", base=2)
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
