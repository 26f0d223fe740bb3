"""The CPU paged-decode kernel (`csrc/paged_decode.c`): built on first use, called through ctypes.

Why C and not a torch extension: the kernel needs no torch headers, so the
system C compiler builds it in about a second instead of the minute a
`torch.utils.cpp_extension` build takes. It links the same `libgomp.so.1`
that torch already loaded (same soname), so it shares torch's OpenMP threads.

The shared object is cached under `$KVFORGE_CACHE_DIR` (default
`~/.cache/kvforge/kernels`), keyed by the source, the compiler and this CPU,
since `-march=native` code must not move to another machine. Without a
compiler (or with `KVFORGE_CPU_KERNEL=0`) `available()` is False and the
attention backends fall back to gathering blocks in torch; nothing else changes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Not -ffast-math: with it, loading the object would switch the whole process to flush-to-zero.
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(CFLAGS).encode() + version.encode() + _cpu_fingerprint().encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("KVFORGE_CACHE_DIR", Path.home() / ".cache" / "kvforge")) / "kernels"
    return root / f"paged_decode-{key}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    global _lib, _load_error
    if _lib is not None or _load_error is not None:
        return _lib
    with _lock:
        if _lib is not None or _load_error is not None:
            return _lib
        if os.environ.get("KVFORGE_CPU_KERNEL", "1") == "0":
            _load_error = "disabled by KVFORGE_CPU_KERNEL=0"
            return None
        compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if compiler is None:
            _load_error = "no C compiler (gcc/cc) on PATH"
            return None
        try:
            path = _cache_path(compiler)
            if not path.exists():
                _build(compiler, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            _load_error = f"building the CPU decode kernel failed: {detail.strip()[:500]}"
            return None
        fn = lib.kvf_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
        _lib = lib
        return _lib


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _load_error


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when the kernel can serve these tensors (CPU, one dtype for q and cache, contiguous)."""
    return (
        q.device.type == "cpu" and q.dtype in DTYPE_CODES and k_cache.dtype == q.dtype == v_cache.dtype
        and k_cache.is_contiguous() and v_cache.is_contiguous() and available()
    )


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q [B, H, D], caches [NB, BS, Hkv, D|Dv], tables [B, nb], seq_lens [B] -> [B, H, Dv] in q's dtype."""
    lib = _load()
    assert lib is not None, _load_error
    b, h, d = q.shape
    nb_total, bs, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    # The kernel trusts its indices: a stray block id or length would read outside the pool.
    if b and (int(tables.max()) >= nb_total or int(tables.min()) < 0 or int(lens.max()) > tables.shape[1] * bs):
        raise ValueError("block table or sequence length out of range of the KV pool")
    out = torch.empty(b, h, dv, dtype=q.dtype)
    rc = lib.kvf_paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        b, h, hkv, d, dv, bs, tables.shape[1], sliding_window or 0, scale, softcap or 0.0, DTYPE_CODES[q.dtype],
    )
    if rc != 0:
        raise MemoryError("CPU decode kernel could not allocate its scratch buffers")
    return out
