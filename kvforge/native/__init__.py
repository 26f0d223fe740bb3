"""Building and loading kvforge's small C libraries (decode attention, fused elementwise ops).

Why C through ctypes and not torch extensions: the sources need no torch
headers, so the system C compiler builds each in seconds (5-16 s for the
attention kernels on a small CPU, announced on stderr) instead of the minute a
`torch.utils.cpp_extension` build takes. They link the same
`libgomp.so.1` that torch already loaded (same soname), so they share torch's
OpenMP threads.

Each shared object is cached under `$KVFORGE_CACHE_DIR` (default
`~/.cache/kvforge/kernels`), keyed by the source, the flags, the compiler and
this CPU, since `-march=native` code must not move to another machine. Without
a compiler, or with the library's switch-off variable set to 0, loading
returns the reason instead, and callers keep their torch paths.
`KVFORGE_EXTRA_CFLAGS` appends compiler flags (e.g. `-mno-avx512f` to build
the portable paths that CPUs without AVX-512 get; the tests do).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Not -ffast-math: with it, loading the object would switch the whole process to flush-to-zero.
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cache_root() -> Path:
    """kvforge's on-disk cache: `$KVFORGE_CACHE_DIR`, default `~/.cache/kvforge` (kernels, tokenizers)."""
    return Path(os.environ.get("KVFORGE_CACHE_DIR", Path.home() / ".cache" / "kvforge"))


def cache_path(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        source.read_bytes() + " ".join(flags).encode() + version.encode() + _cpu_fingerprint().encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{key}.so"


def build(source: Path, compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(source), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass
class NativeLibrary:
    """One C source, compiled on first use; `load()` gives the library or None (see `error`)."""

    source: Path
    switch_env: str  # set to 0 to keep the torch paths
    what: str  # for messages: "the CPU decode kernel"
    declare: Callable[[ctypes.CDLL], None]  # sets restype/argtypes
    extra_flags: tuple[str, ...] = ()
    _lib: ctypes.CDLL | None = field(default=None, init=False, repr=False)
    error: str | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def load(self) -> ctypes.CDLL | None:
        if self._lib is not None or self.error is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self.error is None:
                self._lib, self.error = self._load_locked()
        return self._lib

    def _load_locked(self) -> tuple[ctypes.CDLL | None, str | None]:
        if os.environ.get(self.switch_env, "1") == "0":
            return None, f"disabled by {self.switch_env}=0"
        compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if compiler is None:
            return None, "no C compiler (gcc/cc) on PATH"
        flags = CFLAGS + self.extra_flags + tuple(os.environ.get("KVFORGE_EXTRA_CFLAGS", "").split())
        try:
            path = cache_path(self.source, compiler, flags)
            if not path.exists():
                # 5-16 s for paged_decode.c on a small CPU: say so, once; later runs load the cached object
                print(f"kvforge: compiling CPU kernels ({self.what}), once for this CPU... (cache: {path})",
                      file=sys.stderr, flush=True)
                start = time.perf_counter()
                build(self.source, compiler, flags, path)
                print(f"kvforge: compiled {path.name} in {time.perf_counter() - start:.1f} s",
                      file=sys.stderr, flush=True)
            lib = ctypes.CDLL(str(path))
            self.declare(lib)
        except (OSError, AttributeError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            return None, f"building {self.what} failed: {detail.strip()[:500]}"
        return lib, None
