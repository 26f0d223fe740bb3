"""The CPU paged-attention kernels: decode rows (`csrc/paged_decode.c`) and, for head size 64,
prefill chunks (`csrc/paged_prefill.c`), both reading K/V in place from the block pool (what they
share is `csrc/paged_common.h`). One library of four units (decode's 8-bit and AVX2 kernels are units of
their own: `paged_decode_q8.c`, `paged_decode_avx2.c`), compiled side by side on first use, called
through ctypes.

The decode kernel also reads compressed pools in place: a `PoolView` describes one of K/V as it
lies in memory (fp8/int8/int4 codes and their scales, or rows of another float dtype), and the
kernel decodes each row into registers the way `kvforge.kv.quant.dequantize` does. `pool_view`
builds one from a dense tensor or a `QuantizedKVCache` store; MLA passes its latent pool twice
(K = the whole latent row, V = its first `kv_lora_rank` elements).

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

# the decode driver, its 8-bit and AVX2 kernels, and prefill: four units compiled side by side, then linked
SOURCES = tuple(Path(__file__).parent / "csrc" / f"{unit}.c"
                for unit in ("paged_decode", "paged_decode_q8", "paged_decode_avx2", "paged_prefill"))
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FORMAT_CODES = {"fp8_e4m3": 3, "fp8_e5m2": 4, "int8": 5, "int4": 6}  # kvforge.kv.quant format names
SCALE_CODES = {None: 0, "tensor": 1, "token": 2, "head": 3, "channel": 4}


class _KV(ctypes.Structure):
    """`kvf_kv` in paged_decode.c: one of K/V as it lies in the pool."""

    _fields_ = [("data", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("head_bytes", ctypes.c_int64), ("heads", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("code", ctypes.c_int32), ("gran", ctypes.c_int32)]


@dataclass(frozen=True)
class PoolView:
    """One of K/V as the decode kernel reads it in place: the pool tensor (block index first, token
    second) and how to decode a row. `data`/`scale` stay referenced while the view lives."""

    data: torch.Tensor  # [NB, BS, ...] values or uint8 codes, contiguous
    code: int  # DTYPE_CODES value or FORMAT_CODES value
    heads: int
    dim: int  # elements per head (what the kernel reads), <= what a row holds per head
    head_bytes: int
    granularity: str | None = None
    scale: torch.Tensor | None = None  # float32, contiguous; None when granularity is None

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    def struct(self) -> _KV:
        row_bytes = self.data[0, 0].numel() * self.data.element_size()
        return _KV(self.data.data_ptr(), 0 if self.scale is None else self.scale.data_ptr(), row_bytes,
                   self.head_bytes, self.heads, self.dim, self.code, SCALE_CODES[self.granularity])


def dense_view(t: torch.Tensor) -> PoolView:
    """A float pool [NB, BS, heads, dim]."""
    return PoolView(t, DTYPE_CODES[t.dtype], t.shape[2], t.shape[3], t.shape[3] * t.element_size())


def store_view(store) -> PoolView | None:  # type: ignore[no-untyped-def]
    """A `kvforge.kv.storage.k_or_v_stores` DenseStore or QuantStore as the kernel reads it (None: not readable)."""
    data = store.data
    if not data.is_contiguous() or data.device.type != "cpu":
        return None
    fmt = getattr(store, "fmt", None)
    if fmt is None:
        return dense_view(data) if data.dtype in DTYPE_CODES else None
    heads, stored = data.shape[2], data.shape[3]
    dim = stored * 2 if fmt.packed else stored
    if store.granularity == "tensor":  # a store never written (or calibrated) reads with scale 1, as gather does
        scale = store.static_scale if store.static_scale is not None else torch.ones(())
        scale = scale.reshape(1).to(torch.float32).contiguous()
    else:
        scale = store.scale
    return PoolView(data, FORMAT_CODES[fmt.name], heads, dim, stored, store.granularity, scale)


def latent_views(latent: torch.Tensor, kv_lora_rank: int) -> tuple[PoolView, PoolView]:
    """An MLA latent pool [NB, BS, rank + rope] as one-head K (the whole row) and V (its first `rank`)."""
    esz = latent.element_size()
    code = DTYPE_CODES[latent.dtype]
    return (PoolView(latent, code, 1, latent.shape[2], latent.shape[2] * esz),
            PoolView(latent, code, 1, kv_lora_rank, kv_lora_rank * esz))


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvf_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.POINTER(_KV), ctypes.POINTER(_KV)] + [ctypes.c_void_p] * 3
                   + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_float, ctypes.c_int])
    fn = lib.kvf_dequant_row
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_KV)] + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_void_p]
    fn = lib.kvf_paged_prefill
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.POINTER(_KV), ctypes.POINTER(_KV), ctypes.c_void_p, ctypes.c_int64]
                   + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
                   + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_float, ctypes.c_int])
    fn = lib.kvf_paged_prefill_supported
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int]
    lib.kvf_set_bf16_fma.restype = None
    lib.kvf_set_bf16_fma.argtypes = [ctypes.c_int]
    lib.kvf_set_bf16_fma(int(_bf16_fma))
    lib.kvf_set_prefill_lanes.restype = None
    lib.kvf_set_prefill_lanes.argtypes = [ctypes.c_int]
    lib.kvf_set_prefill_lanes(int(_prefill_lanes))
    lib.kvf_set_bf16_amx.restype = ctypes.c_int
    lib.kvf_set_bf16_amx.argtypes = [ctypes.c_int]
    global _bf16_amx_on
    _bf16_amx_on = bool(lib.kvf_set_bf16_amx(int(_bf16_amx)))


_bf16_fma = False  # see set_bf16_fma
_prefill_lanes = True  # see set_prefill_lanes
_bf16_amx = False  # see set_bf16_amx: asked for
_bf16_amx_on = False  # and granted by the loaded kernel (its build has AMX, Linux gave the tile state)


def set_bf16_fma(on: bool) -> None:
    """Run bf16 prefill attention on fp32 FMAs (bf16 operands widened; same exact products, fp32
    probabilities) instead of AVX512-BF16's `vdpbf16ps`.

    Why: which one is faster depends on the CPU (Zen 4 retires one vdpbf16ps a cycle, twice its fp32 FMA
    rate; the Intel Xeons seen here one every ~2 cycles against two FMAs a cycle). The bf16 panel kernel
    measures it once at load (`panel_linear.bf16_gemm_mode`) and passes its choice here, so attention and
    the linear layers multiply bf16 the same way."""
    global _bf16_fma
    _bf16_fma = bool(on)
    for lib in loaded_libraries():  # applied now to those loaded, else when one loads (`_declare`)
        lib._lib.kvf_set_bf16_fma(int(_bf16_fma))


def bf16_fma() -> bool:
    return _bf16_fma


def set_prefill_lanes(on: bool) -> None:
    """Prefill with query vectors in lanes (on, the default) or keys in lanes (off: the loop bf16 takes on
    AVX-512 CPUs without AVX512-BF16). Why: so tests run both loops on any AVX-512 CPU; users never need it."""
    global _prefill_lanes
    _prefill_lanes = bool(on)
    for lib in loaded_libraries():  # applied now to those loaded, else when one loads (`_declare`)
        lib._lib.kvf_set_prefill_lanes(int(_prefill_lanes))


def prefill_lanes() -> bool:
    return _prefill_lanes


def set_bf16_amx(on: bool) -> bool:
    """Run bf16 prefill attention on AMX tiles where this build has them and Linux grants the tile state
    (taken before `set_bf16_fma`'s choice); returns whether they run (always False before the kernel loads
    and where they cannot).

    Why: on Xeons with AMX the tile unit multiplies bf16 several times faster than either vector path, and
    the lanes layout's queries and key-paired V rows are already AMX operands. The bf16 panel kernel passes
    its choice here (AMX GEMM tiles, `panel_linear.bf16_gemm_mode`), so `KVFORGE_BF16_GEMM=fma|dot` keeps
    attention off the tiles too."""
    global _bf16_amx, _bf16_amx_on
    _bf16_amx = bool(on)
    loaded = loaded_libraries()  # applied now to those loaded, else when one loads (`_declare`)
    for lib in loaded:
        _bf16_amx_on = bool(lib._lib.kvf_set_bf16_amx(int(_bf16_amx)))
    return _bf16_amx_on if loaded else False


def bf16_amx() -> bool:
    """Whether bf16 prefill attention runs on AMX tiles (asked for, and possible here)."""
    _load()  # applies the request if this is the first use
    return _bf16_amx_on


# gcc clones each outlined decode kernel once per head-group size G it is called with only when told that
# every clone pays (paged_common.h, KVF_OUTLINED): the variants stay specialized, and the decode unit
# compiles in ~17 s of CPU instead of ~64 s with every variant inlined into one function.
IPA_CP_CLONES = ("--param=ipa-cp-eval-threshold=1", "--param=ipa-cp-unit-growth=100000",
                 "--param=ipa-cp-large-unit-insns=10000000")
ALL_GROUPS = 0xFF  # KVF_G_MASK: bit G-1 gives G query heads per KV head its vector clones


def group_mask(group: int | None) -> int:
    """KVF_G_MASK for a library serving `group` query heads per KV head (None: every G, 1..8). Groups
    above 8 have no clones (the portable loops serve them), so their library compiles none."""
    if group is None:
        return ALL_GROUPS
    return 1 << (group - 1) if 1 <= group <= 8 else 0


def _new_library(mask: int) -> NativeLibrary:
    what = "the CPU attention kernels" + ("" if mask == ALL_GROUPS else
                                          f" for {mask.bit_length()} query heads per KV head" if mask
                                          else " for groups above 8 query heads per KV head")
    flags = IPA_CP_CLONES + (() if mask == ALL_GROUPS else (f"-DKVF_G_MASK={mask:#x}",))
    return NativeLibrary(SOURCES, "KVFORGE_CPU_KERNEL", what, _declare, flags)


# The full library (every G; kernel tests and benchmarks) and the narrow ones engines build, by mask.
LIBRARY = _new_library(ALL_GROUPS)
_LIBRARIES: dict[int, NativeLibrary] = {}


def _covering(group: int | None) -> ctypes.CDLL | None:
    """A loaded library that has `group`'s clones (any loaded one for None), or None."""
    if LIBRARY._lib is not None:  # first: a benchmark may swap another build in here
        return LIBRARY._lib
    need = 0 if group is None else group_mask(group)
    for mask, lib in list(_LIBRARIES.items()):
        if lib._lib is not None and mask & need == need:
            return lib._lib
    return None


def group_library(group: int) -> NativeLibrary:
    """The library with vector clones for `group` query heads per KV head alone (one object per mask)."""
    mask = group_mask(group)
    if mask not in _LIBRARIES:
        _LIBRARIES[mask] = _new_library(mask)
    return _LIBRARIES[mask]


def library_for(group: int | None) -> NativeLibrary:
    """The library an engine whose model has `group` query heads per KV head loads: one already loaded
    that covers the group, else the group's own (`group_library`, built on first use or by `prebuild`).

    Why: the vector paths are cloned per G, and the eight clones are most of the CPU the first-run
    compile takes; one model needs one of them. Another G in the same process builds its own library on
    first use, and a narrow library gives every G correct results (the portable loops)."""
    if group is None or LIBRARY._lib is not None:
        return LIBRARY
    mask = group_mask(group)
    for m, lib in list(_LIBRARIES.items()):
        if lib._lib is not None and m & mask == mask:
            return lib
    return group_library(group)


def loaded_libraries() -> list[NativeLibrary]:
    return [lib for lib in (LIBRARY, *_LIBRARIES.values()) if lib._lib is not None]


def _load(group: int | None = None) -> ctypes.CDLL | None:
    """The library for `group` (see `library_for`); None asks for any: a loaded one, else one an engine
    has asked for, else the full build."""
    lib = _covering(group)
    if lib is not None:
        return lib
    if group is None:
        return (next(iter(_LIBRARIES.values())) if _LIBRARIES else LIBRARY).load()
    return library_for(group).load()


def load_library(group: int | None = None) -> ctypes.CDLL | None:
    """The loaded library `paged_decode` would call for `group` (the fused decode layers call it too)."""
    return _load(group)


def _error(group: int | None = None) -> str | None:
    lib = library_for(group) if group is not None else (next(iter(_LIBRARIES.values())) if _LIBRARIES else LIBRARY)
    return lib.error


def available(group: int | None = None) -> bool:
    return _load(group) is not None


def unavailable_reason(group: int | None = None) -> str | None:
    _load(group)
    return _error(group)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when the kernels can serve these dense tensors (CPU, one dtype for q and cache, contiguous)."""
    return (
        q.device.type == "cpu" and q.dtype in DTYPE_CODES and k_cache.dtype == q.dtype == v_cache.dtype
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and available(q.shape[1] // k_cache.shape[2] if q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape[2] else None)
    )


def supports_views(q: torch.Tensor, k: PoolView | None, v: PoolView | None) -> bool:
    """True when the decode kernel can read these views for q (any storage format, CPU, same pool shape)."""
    return (k is not None and v is not None and q.device.type == "cpu" and q.dtype in DTYPE_CODES
            and k.data.shape[:2] == v.data.shape[:2] and k.heads == v.heads
            and available(q.shape[1] // k.heads if q.dim() == 3 and k.heads else None))


def dequantize_row(view: PoolView, slot: int, head: int, compute: torch.dtype) -> torch.Tensor:
    """Row `slot`, head `head` of a view decoded exactly as the kernel decodes it (fp32 result; for tests)."""
    lib = _load()
    assert lib is not None, _error()
    out = torch.empty(view.dim, dtype=torch.float32)
    st = view.struct()
    lib.kvf_dequant_row(ctypes.byref(st), slot, head, view.dim, view.block_size, DTYPE_CODES[compute], out.data_ptr())
    return out


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
    q: torch.Tensor, k_cache: torch.Tensor | PoolView, v_cache: torch.Tensor | PoolView,
    block_tables: torch.Tensor | DecodeIndices, seq_lens: torch.Tensor | None, scale: float,
    sliding_window: int | None = None, softcap: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D], caches [NB, BS, Hkv, D|Dv] (dense tensors, or `PoolView`s of any stored format),
    tables [B, nb], seq_lens [B] (or checked `DecodeIndices` and None) -> [B, H, Dv] in q's dtype,
    written into `out` (contiguous) when given."""
    k, v = as_view(k_cache), as_view(v_cache)
    b, h, d = q.shape
    hkv, dv = k.heads, v.dim
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    lib = _load(h // hkv)
    assert lib is not None, _error(h // hkv)
    if d != k.dim:
        raise ValueError(f"query head size ({d}) differs from the key head size ({k.dim})")
    q = q.contiguous()
    idx = (block_tables if isinstance(block_tables, DecodeIndices)
           else decode_indices(block_tables, seq_lens, k.num_blocks, k.block_size))
    if out is None:
        out = torch.empty(b, h, dv, dtype=q.dtype)
    assert out.is_contiguous() and out.shape == (b, h, dv) and out.dtype == q.dtype
    ks, vs = k.struct(), v.struct()
    rc = lib.kvf_paged_decode(
        q.data_ptr(), ctypes.byref(ks), ctypes.byref(vs), idx.tables.data_ptr(), idx.seq_lens.data_ptr(),
        out.data_ptr(), b, h, hkv, d, dv, k.block_size, idx.tables.shape[1], sliding_window or 0, scale,
        softcap or 0.0, DTYPE_CODES[q.dtype],
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


def as_view(cache: torch.Tensor | PoolView) -> PoolView:
    """A dense pool tensor as a view; a view as it is (what both kernels read)."""
    return cache if isinstance(cache, PoolView) else dense_view(cache)


def prefill_supported(q: torch.Tensor, k_cache: torch.Tensor | PoolView | None,
                      v_cache: torch.Tensor | PoolView | None) -> bool:
    """The prefill kernel's reach: head size 64, at most 8 query heads per KV head, fp32/bf16 compute,
    AVX-512; K/V dense tensors of q's dtype, or views of any storage format (`store_view`)."""
    if q.dim() != 3 or k_cache is None or v_cache is None:
        return False
    if any(isinstance(t, torch.Tensor) and not supports(q, t, t) for t in (k_cache, v_cache)):
        return False  # raw tensors: q's dtype, contiguous
    k, v = as_view(k_cache), as_view(v_cache)
    if k.heads < 1 or q.shape[1] % k.heads:
        return False
    lib = _load(q.shape[1] // k.heads)
    return (lib is not None and supports_views(q, k, v) and k.dim == q.shape[2]
            and bool(lib.kvf_paged_prefill_supported(q.shape[1], k.heads, k.dim, v.dim, DTYPE_CODES[q.dtype])))


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor | PoolView, v_cache: torch.Tensor | PoolView, idx: PrefillIndices,
    scale: float, sliding_window: int | None, softcap: float | None, out: torch.Tensor,
) -> torch.Tensor:
    """Attention of every prefill chunk's rows of q [T, H, 64] (causal over cached prefix + chunk),
    written into the same rows of `out` [T, H, 64]; needs `prefill_supported`. Compressed K/V (views)
    are decoded in the kernel's block loop, as the decode kernel's portable loops decode them."""
    assert prefill_supported(q, k_cache, v_cache)
    k, v = as_view(k_cache), as_view(v_cache)
    lib = _load(q.shape[1] // k.heads)
    q = q.contiguous()
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype
    ks, vs = k.struct(), v.struct()
    rc = lib.kvf_paged_prefill(
        q.data_ptr(), ctypes.byref(ks), ctypes.byref(vs), idx.tables.data_ptr(), idx.tables.shape[1],
        idx.row0.data_ptr(), idx.qlen.data_ptr(), idx.start.data_ptr(), idx.tables.shape[0], out.data_ptr(),
        q.shape[1], k.heads, k.block_size, sliding_window or 0, scale, softcap or 0.0,
        DTYPE_CODES[q.dtype],
    )
    if rc != 0:
        raise MemoryError("CPU prefill kernel could not allocate its scratch buffers")
    return out
