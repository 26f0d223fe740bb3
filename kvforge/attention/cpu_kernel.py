"""The CPU paged-decode kernel (`csrc/paged_decode.c`): built on first use, called through ctypes.

How it is built, cached and switched off is `kvforge.native`'s job. Without a
compiler (or with `KVFORGE_CPU_KERNEL=0`) `available()` is False and the
attention backends fall back to gathering blocks in torch; nothing else changes.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvforge.native import NativeLibrary

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvf_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]


LIBRARY = NativeLibrary(SOURCE, "KVFORGE_CPU_KERNEL", "the CPU decode kernel", _declare)


def _load() -> ctypes.CDLL | None:
    return LIBRARY.load()


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return LIBRARY.error


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
    assert lib is not None, LIBRARY.error
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
