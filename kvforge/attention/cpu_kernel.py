"""The CPU paged-attention kernels (`csrc/paged_decode.c`): decode rows and, for head size 64,
prefill chunks, both reading K/V in place from the block pool. Built on first use, called
through ctypes.

How it is built, cached and switched off is `kvforge.native`'s job. Without a
compiler (or with `KVFORGE_CPU_KERNEL=0`) `available()` is False and the
attention backends fall back to gathering blocks in torch; nothing else changes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.native import NativeLibrary

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvf_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
    fn = lib.kvf_paged_prefill
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
                   + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_float, ctypes.c_int])
    fn = lib.kvf_paged_prefill_supported
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int]


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


@dataclass(frozen=True)
class DecodeIndices:
    """A step's decode block tables and lengths, checked against the pool once (every layer reuses them)."""

    tables: torch.Tensor  # [B, nb] int64, contiguous
    seq_lens: torch.Tensor  # [B] int64


def decode_indices(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> DecodeIndices:
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    # The kernels trust their indices: a stray block id or length would read outside the pool.
    if tables.shape[0] and (int(tables.max()) >= num_blocks or int(tables.min()) < 0
                            or int(lens.max()) > tables.shape[1] * block_size or int(lens.min()) < 1):
        raise ValueError("block table or sequence length out of range of the KV pool")
    return DecodeIndices(tables, lens)


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor | DecodeIndices,
    seq_lens: torch.Tensor | None, scale: float, sliding_window: int | None = None, softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D], caches [NB, BS, Hkv, D|Dv], tables [B, nb], seq_lens [B] (or checked `DecodeIndices`
    and None) -> [B, H, Dv] in q's dtype, written into `out` (contiguous) when given."""
    lib = _load()
    assert lib is not None, LIBRARY.error
    b, h, d = q.shape
    nb_total, bs, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    q = q.contiguous()
    idx = block_tables if isinstance(block_tables, DecodeIndices) else decode_indices(block_tables, seq_lens, nb_total, bs)
    if out is None:
        out = torch.empty(b, h, dv, dtype=q.dtype)
    assert out.is_contiguous() and out.shape == (b, h, dv) and out.dtype == q.dtype
    rc = lib.kvf_paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), idx.tables.data_ptr(), idx.seq_lens.data_ptr(),
        out.data_ptr(), b, h, hkv, d, dv, bs, idx.tables.shape[1], sliding_window or 0, scale, softcap or 0.0,
        DTYPE_CODES[q.dtype],
    )
    if rc != 0:
        raise MemoryError("CPU decode kernel could not allocate its scratch buffers")
    return out


@dataclass(frozen=True)
class PrefillIndices:
    """A step's prefill chunks as the prefill kernel reads them, checked against the pool once."""

    tables: torch.Tensor  # [C, nb] int64, padded with block 0
    row0: torch.Tensor  # [C] first row of each chunk in the step's flattened batch
    qlen: torch.Tensor  # [C] new tokens of each chunk
    start: torch.Tensor  # [C] tokens already cached before each chunk


def prefill_indices(chunks: list, num_rows: int, num_blocks: int, block_size: int) -> PrefillIndices:
    width = max(int(c.block_table.shape[0]) for c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for i, c in enumerate(chunks):
        tables[i, : c.block_table.shape[0]] = c.block_table
    row0 = torch.tensor([c.rows.start for c in chunks], dtype=torch.int64)
    qlen = torch.tensor([c.rows.stop - c.rows.start for c in chunks], dtype=torch.int64)
    start = torch.tensor([c.start for c in chunks], dtype=torch.int64)
    if (int(tables.max()) >= num_blocks or int(tables.min()) < 0 or int(qlen.min()) < 1 or int(start.min()) < 0
            or int((row0 + qlen).max()) > num_rows
            or any(s + n > c.block_table.shape[0] * block_size for s, n, c in zip(start.tolist(), qlen.tolist(), chunks))):
        raise ValueError("prefill chunk rows, block table or length out of range")
    return PrefillIndices(tables, row0, qlen, start)


def prefill_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The prefill kernel's reach: head size 64, at most 8 query heads per KV head, fp32/bf16, AVX-512."""
    lib = _load()
    return (lib is not None and q.dim() == 3 and supports(q, k_cache, v_cache)
            and bool(lib.kvf_paged_prefill_supported(q.shape[1], k_cache.shape[2], q.shape[2], v_cache.shape[-1],
                                                     DTYPE_CODES[q.dtype])))


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: PrefillIndices, scale: float,
    sliding_window: int | None, softcap: float | None, out: torch.Tensor,
) -> torch.Tensor:
    """Attention of every prefill chunk's rows of q [T, H, 64] (causal over cached prefix + chunk),
    written into the same rows of `out` [T, H, 64]; needs `prefill_supported`."""
    lib = _load()
    assert lib is not None and prefill_supported(q, k_cache, v_cache)
    q = q.contiguous()
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype
    rc = lib.kvf_paged_prefill(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), idx.tables.data_ptr(), idx.tables.shape[1],
        idx.row0.data_ptr(), idx.qlen.data_ptr(), idx.start.data_ptr(), idx.tables.shape[0], out.data_ptr(),
        q.shape[1], k_cache.shape[2], k_cache.shape[1], sliding_window or 0, scale, softcap or 0.0,
        DTYPE_CODES[q.dtype],
    )
    if rc != 0:
        raise MemoryError("CPU prefill kernel could not allocate its scratch buffers")
    return out
