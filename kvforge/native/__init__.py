"""Building and loading kvforge's small C libraries (decode attention, fused elementwise ops).

Why C through ctypes and not torch extensions: the sources need no torch
headers, so the system C compiler builds them without torch's build machinery
(announced on stderr, once per CPU and source version; the attention library's
two units compile side by side). They link the same
`libgomp.so.1` that torch already loaded (same soname), so they share torch's
OpenMP threads.

Each shared object is cached under `$KVFORGE_CACHE_DIR` (default
`~/.cache/kvforge/kernels`), keyed by the sources and every header they include, the flags, the compiler
and this CPU, since `-march=native` code must not move to another machine. Without
a compiler, or with the library's switch-off variable set to 0, loading
returns the reason instead, and callers keep their torch paths.
`KVFORGE_EXTRA_CFLAGS` appends compiler flags (e.g. `-mno-avx512f` to build
the portable paths that CPUs without AVX-512 get; the tests do).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvforge import envs

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
    return envs.KVFORGE_CACHE_DIR


INCLUDE_DIR = Path(__file__).resolve().parent.parent / "csrc" / "include"  # the kernels' shared headers
_QUOTED_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def included_files(sources: tuple[Path, ...], include_dirs: tuple[Path, ...] = (INCLUDE_DIR,)) -> list[Path]:
    """`sources` and every file they `#include "..."`, transitively (resolved as gcc does: beside the
    including file, then the `-I` dirs), each once, in a stable order. Why: the cache key must change
    when a shared header does, or an edited header would keep loading the old object."""
    seen: dict[Path, None] = {}
    todo = [s.resolve() for s in sources]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen[path] = None
        for name in _QUOTED_INCLUDE.findall(path.read_bytes()):
            rel = name.decode()
            found = next((d / rel for d in (path.parent, *include_dirs) if (d / rel).is_file()), None)
            if found is not None:  # a missing header is the compiler's error to report
                todo.append(found.resolve())
    return list(seen)


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    """`compiler --version`, asked once per process (every library's cache key needs it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout


def cache_key(sources: tuple[Path, ...], compiler: str, flags: tuple[str, ...],
              include_dirs: tuple[Path, ...] = (INCLUDE_DIR,)) -> str:
    """What the built object depends on: every source and header it includes (by content), the flags,
    the compiler's version and this CPU."""
    version = _compiler_version(compiler)
    digest = hashlib.sha256()
    for path in included_files(sources, include_dirs):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags).encode() + version.encode() + _cpu_fingerprint().encode())
    return digest.hexdigest()[:16]


def cache_path(sources: tuple[Path, ...], compiler: str, flags: tuple[str, ...]) -> Path:
    return cache_root() / "kernels" / f"{sources[0].stem}-{cache_key(sources, compiler, flags)}.so"


def build(sources: tuple[Path, ...], compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile `sources` into the shared object `target`. Several sources compile as separate units at
    once (one process each) and are then linked: the attention kernel's decode and prefill halves build
    side by side on a 2-core machine instead of one after the other."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    work = Path(tempfile.mkdtemp(prefix=f".{target.stem}-", dir=target.parent))
    try:
        include = (f"-I{INCLUDE_DIR}",)
        tmp = work / target.name
        if len(sources) == 1:
            _run([[compiler, *include, *flags, "-o", str(tmp), str(sources[0]), "-lm"]])
        else:
            compile_flags = tuple(f for f in flags if f != "-shared")
            objects = [work / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
            _run([[compiler, *include, *compile_flags, "-c", "-o", str(obj), str(src)]
                  for src, obj in zip(sources, objects)])
            _run([[compiler, *flags, "-o", str(tmp), *map(str, objects), "-lm"]])
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(commands: list[list[str]]) -> None:
    """Run the commands at once; raise CalledProcessError (with its stderr) for the first that failed."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    results = [(cmd, proc, *proc.communicate()) for cmd, proc in zip(commands, procs)]
    for cmd, proc, out, err in results:
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@dataclass
class NativeLibrary:
    """C sources compiled into one library on first use; `load()` gives the library or None (see `error`)."""

    source: Path | tuple[Path, ...]  # one file, or the units of one library (built in parallel, then linked)
    switch_env: str | None  # a kvforge.envs switch: set to 0 to keep the torch paths
    what: str  # for messages: "the CPU decode kernel"
    declare: Callable[[ctypes.CDLL], None]  # sets restype/argtypes
    extra_flags: tuple[str, ...] = ()
    _lib: ctypes.CDLL | None = field(default=None, init=False, repr=False)
    error: str | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def sources(self) -> tuple[Path, ...]:
        return self.source if isinstance(self.source, tuple) else (self.source,)

    def load(self) -> ctypes.CDLL | None:
        if self._lib is not None or self.error is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self.error is None:
                self._lib, self.error = self._load_locked()
        return self._lib

    def needs_build(self) -> bool:
        """Whether `load()` would compile: enabled, a compiler on PATH, and no cached object yet."""
        if self._lib is not None or self.error is not None:
            return False
        if self.switch_env is not None and not envs.read(self.switch_env):
            return False
        compiler = _compiler()
        if compiler is None:
            return False
        try:
            return not cache_path(self.sources, compiler, CFLAGS + self.extra_flags + envs.KVFORGE_EXTRA_CFLAGS).exists()
        except (OSError, subprocess.CalledProcessError):
            return False

    def _load_locked(self) -> tuple[ctypes.CDLL | None, str | None]:
        if self.switch_env is not None and not envs.read(self.switch_env):
            return None, f"disabled by {self.switch_env}=0"
        compiler = _compiler()
        if compiler is None:
            return None, "no C compiler (gcc/cc) on PATH"
        flags = CFLAGS + self.extra_flags + envs.KVFORGE_EXTRA_CFLAGS
        try:
            path = cache_path(self.sources, compiler, flags)
            if not path.exists():
                # the attention kernels take the longest (docs/kernel-tuning.md): say so, once; later runs load the cache
                print(f"kvforge: compiling CPU kernels ({self.what}), once for this CPU... (cache: {path})",
                      file=sys.stderr, flush=True)
                start = time.perf_counter()
                build(self.sources, compiler, flags, path)
                print(f"kvforge: compiled {path.name} in {time.perf_counter() - start:.1f} s",
                      file=sys.stderr, flush=True)
            lib = ctypes.CDLL(str(path))
            self.declare(lib)
        except (OSError, AttributeError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            return None, f"building {self.what} failed: {detail.strip()[:500]}"
        return lib, None


def prebuild(*libraries: NativeLibrary) -> list[threading.Thread]:
    """Start building, side by side, the libraries not yet in the cache, each in a daemon thread (a cached one
    is left to its first use, so a warm start loads nothing early).

    Why: each library is otherwise compiled on its first call, one after the next; started together
    while the weights load, the compilers share the cores with the load instead of queueing after it.
    A later `load()` waits on the library's lock for its build to finish."""
    def build_if_missing(lib: NativeLibrary) -> None:
        if lib.needs_build():  # hashing the sources and headers happens here too, off the caller's thread
            lib.load()

    threads = [threading.Thread(target=build_if_missing, args=(lib,), name=f"kvforge-build-{lib.sources[0].stem}",
                                daemon=True) for lib in libraries]
    for t in threads:
        t.start()
    return threads

