"""Progress on stderr for the slow steps a user waits on (model load, `kvforge eval kv-quant`).

On a terminal it is a tqdm bar with an ETA; otherwise (logs, pipes, tests) there
are no bar redraws, only the lines a caller writes, so captured output stays clean.
"""
from __future__ import annotations

import sys
import time
from typing import Any


def stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class _Lines:
    """The non-terminal stand-in for a tqdm bar: same methods, no redraws."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description_str(self, desc: str) -> None:
        self.desc = desc

    def write(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str = "step") -> Any:
    """A tqdm bar on stderr when it is a terminal, else an object with the same update/write/close."""
    if not stderr_is_tty():
        return _Lines(total, desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


class StageProgress:
    """Named stages of one slow job (read weights, build, pack): a bar on a terminal, one summary line always.

        with StageProgress("loading SmolLM2", ["reading weights", "building model", "packing"]) as p:
            ...; p.next(); ...
    """

    def __init__(self, title: str, stages: list[str], quiet: bool = False) -> None:
        self.title, self.stages, self.quiet = title, stages, quiet
        self.times: list[float] = []
        self._bar = _Lines(len(stages), title) if quiet else progress_bar(len(stages), title, unit="stage")
        self._t0 = self._last = time.perf_counter()
        self._bar.set_description_str(f"{title}: {stages[0]}")

    def next(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now
        self._bar.update(1)
        self._describe_next()

    def _describe_next(self) -> None:
        if len(self.times) < len(self.stages):
            self._bar.set_description_str(f"{self.title}: {self.stages[len(self.times)]}")
        else:  # done: no bar left on screen under what the caller prints next (the start-up ledger)
            self._bar.close()

    def split(self, seconds: list[float]) -> None:
        """End the next `len(seconds)` stages at once: stages that ran interleaved (reading and converting
        weights block by block), each given its own measured seconds; what they leave of the time since
        the last stage ended goes to the first of them."""
        now = time.perf_counter()
        rest = max(0.0, now - self._last - sum(seconds))
        self._last = now
        for i, t in enumerate(seconds):
            self.times.append(t + (rest if i == 0 else 0.0))
            self._bar.update(1)
        self._describe_next()

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._bar.close()
        if exc_type is None and not self.quiet:
            parts = ", ".join(f"{name} {t:.1f} s" for name, t in zip(self.stages, self.times))
            print(f"kvforge: {self.title} in {time.perf_counter() - self._t0:.1f} s ({parts})",
                  file=sys.stderr, flush=True)
