"""Starting tensor-parallel ranks from any script, with or without an `if __name__ == "__main__":` guard.

Ranks are spawned: a fresh interpreter per rank. By default Python's spawn re-runs the
parent's main script in each child before calling the target, so a script without the
guard builds an `LLM` inside every rank, which tries to spawn ranks of its own and dies
with Python's bootstrapping error. A rank needs nothing from the main script (its entry
point and the pickled EngineConfig live in kvforge), so the ranks are started with the
main module hidden from `multiprocessing`'s preparation step: the child imports kvforge
and runs the rank, nothing else.

Fork (vLLM's choice where CUDA is not initialised) is not used: importing kvforge already
runs oneDNN, which starts torch's OpenMP threads, and a child forked after that hangs in its
first parallel region (seen in the C panel-linear kernel; docs/security.md).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def main_module_hidden() -> Iterator[None]:
    """While inside, spawned children do not re-run `__main__` (neither a script path nor a `-m` module)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: vars(main)[name] for name in ("__spec__", "__file__") if name in vars(main)}
    main.__spec__ = None  # multiprocessing reads `__main__.__spec__.name`, then `__main__.__file__`
    if "__file__" in saved:
        del main.__file__
    try:
        yield
    finally:
        if "__spec__" not in saved:
            del main.__spec__
        for name, value in saved.items():
            setattr(main, name, value)
