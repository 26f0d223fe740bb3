"""Shared pieces of the `kvforge learn` demos: the engine they measure, prompts, tables and plots."""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

_clock: Callable[[], float] = time.perf_counter


def use_cpu_clock(enabled: bool) -> None:
    """Time the demos in this process's CPU seconds instead of wall seconds.

    On a machine shared with other jobs, wall time mostly measures the wait for a core;
    CPU time measures the work. With one torch thread (--threads 1) CPU seconds equal the
    wall seconds an idle machine would show; with more threads they add up across threads.
    """
    global _clock
    _clock = time.process_time if enabled else time.perf_counter


def now() -> float:
    return _clock()


def clock_label() -> str:
    return "CPU seconds" if _clock is time.process_time else "wall seconds"


def make_engine(model: str | None, dtype: str, threads: int | None = None, **kwargs: Any) -> Any:
    """An LLMEngine without the start-up ledger (the demos print their own tables).

    `threads` sets torch's CPU threads: on a shared, loaded machine one thread per process
    measures far more steadily than threads that wait on each other at every barrier.
    """
    import torch

    from kvforge.engine.args import EngineArgs

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)
    from kvforge.engine.engine import LLMEngine

    return LLMEngine(EngineArgs(model=model, dtype=dtype, log_ledger=False, **kwargs))


def model_label(engine: Any, model: str | None) -> str:
    import torch

    name = model or "SmolLM2-135M-Instruct (default)"
    return f"{name}, {engine.config.model_options.dtype}, {engine.device}, {torch.get_num_threads()} threads, timed in {clock_label()}"


def random_prompts(n: int, lengths: Sequence[int] | int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of random token ids (distinct, so no prefix is shared), each of its given length."""
    rng = random.Random(seed)
    lens = [lengths] * n if isinstance(lengths, int) else list(lengths)
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lens]


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned text table; floats printed as given (format them before)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def save_plot(path: str, draw: Callable[[Any], None]) -> None:
    """Draw with matplotlib (the `plot` extra) into `path`; a clear error if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvforge[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def fmt_g(flops: float) -> str:
    return f"{flops / 1e9:.2f}"


def log_log_axes(ax: Any, xlabel: str, ylabel: str, title: str, xbase: int = 10) -> None:
    """Log-log axes with labels and a legend (both demo line plots)."""
    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
