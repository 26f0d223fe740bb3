"""A loaded model's weights moved, in place, onto fresh pages, 2 MiB ones where the kernel gives them (Linux).

Why: loading leaves the weights on 4 KiB pages scattered across physical memory. They are faulted in
while the page cache fills with the checkpoint and earlier buffers are freed, and the 1B preset's
6 MiB qkv panels sat in 702 different 2 MiB physical frames. Decode streams every weight byte each
step, and streaming scattered pages costs time. On the 2-core Zen 4 VM, with the loaded weights, a
fresh copy and a 2 MiB-page copy run in turn in one process, a decode step's linears ran
1.14-1.19x slower on the loaded weights than on the 2 MiB copy at 4-8 rows, 1.05x at 32; moved in place,
they matched it (benchmarks/results/2026-12-07_weight_pages_1b_bf16_ab.txt). Where the kernel gives 2 MiB pages
(`madvise(MADV_HUGEPAGE)`, which its default THP mode "madvise" asks for), they also save the TLB
misses.

How: each weight storage of 64 KiB or more is copied out a chunk at a time into a small scratch buffer.
The chunk's pages are then dropped (`MADV_DONTNEED`) and the bytes copied back, so the first write
faults in new pages. The virtual addresses stay the same: no tensor, view or tied weight is rewired.
The pieces go to one worker thread per torch thread (up to 8): the new pages' faults, where the kernel
zeroes and may first compact memory for each 2 MiB page, take most of the time, and they run side by
side (a 2 GB buffer on this VM: 2.2-5.0 s on one thread, 0.3-1.5 s on two; the 1B preset's 2.15 GB of
weights, 2.7 s on two). The extra memory is a 4 MiB scratch
buffer per worker. Only whole pages inside a storage are touched, and
only in private anonymous mappings (the heap, or anonymous `mmap`). A file-backed mapping is never
dropped: a shared one would write the file, and a private one would revert to the file's bytes.

`KVFORGE_WEIGHT_PAGES=0` leaves the pages as loaded (the A/B switch, and a way out should a kernel
refuse).
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, is_dataclass
from typing import Iterable

import torch

from kvforge.ledger import format_bytes

HUGE_PAGE = 2 << 20
CHUNK = 4 << 20  # bytes re-faulted at a time: each worker's scratch buffer
MIN_BYTES = 64 << 10  # smaller storages are left alone: few whole pages, a syscall each
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14


@dataclass(frozen=True)
class WeightPages:
    """What `settle_weight_pages` did; `describe()` is the load report's line."""

    moved_bytes: int  # bytes whose pages were re-faulted
    weight_bytes: int  # bytes of the weight storages of MIN_BYTES or more
    huge_bytes_before: int  # the process's AnonHugePages before ...
    huge_bytes_after: int  # ... and after
    seconds: float
    skipped: str | None = None  # why nothing moved, when nothing did

    def describe(self) -> str:
        if self.skipped:
            return f"weights stay on the pages they were loaded into ({self.skipped})"
        gained = max(0, self.huge_bytes_after - self.huge_bytes_before)
        return (f"{format_bytes(self.moved_bytes)} of {format_bytes(self.weight_bytes)} of weights moved onto fresh "
                f"pages in {self.seconds:.1f} s, {format_bytes(gained)} of them 2 MiB pages")


def private_anonymous_ranges(maps: str) -> list[tuple[int, int]]:
    """The [start, end) of each writable private anonymous mapping in /proc/self/maps' text: no file behind
    it, or the heap. Stacks, vdso and every file mapping are left out."""
    out = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        path = parts[5].strip() if len(parts) == 6 else ""
        perms = parts[1]
        if perms[:2] != "rw" or perms[3] != "p" or path not in ("", "[heap]"):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end))
    return out


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching [start, end) spans joined (tied weights and views share a storage)."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def refault_ranges(spans: list[tuple[int, int]], mappings: list[tuple[int, int]],
                   page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """The page-aligned parts of `spans` that lie inside one of `mappings` (both sorted, disjoint): the
    ranges whose pages may be dropped and faulted in again. A span's first and last partial pages are left
    out, since another allocation may share them."""
    out = []
    for start, end in spans:
        a, e = -(-start // page) * page, end // page * page
        for m0, m1 in mappings:
            lo, hi = max(a, m0), min(e, m1)
            if hi > lo:
                out.append((lo, hi))
    return out


def chunks(start: int, end: int, size: int = CHUNK, align: int = HUGE_PAGE) -> list[tuple[int, int]]:
    """[start, end) in pieces of at most `size` bytes (a multiple of `align`) whose inner boundaries fall on
    `align`: every 2 MiB region inside the range is then dropped whole before it is written again, so it can
    fault in as one page."""
    out, at = [], start
    while at < end:
        nxt = min(end, at // align * align + size)
        out.append((at, nxt))
        at = nxt
    return out


def weight_spans(model: torch.nn.Module, min_bytes: int = MIN_BYTES) -> list[tuple[int, int]]:
    """The [start, end) of every CPU tensor storage of at least `min_bytes` that `model` holds: parameters,
    buffers, and the packed layouts kept beside them (a Linear's panels or int8 / int4 codes, as tensors or
    as dataclass fields), merged."""
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        tensors.extend(module.parameters(recurse=False))
        tensors.extend(module.buffers(recurse=False))
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif is_dataclass(value) and not isinstance(value, type):
                tensors.extend(v for f in fields(value) if isinstance(v := getattr(value, f.name, None), torch.Tensor))
    spans = []
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() >= min_bytes:
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return merge_spans(spans)


def _anon_huge_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def settle_weight_pages(model: torch.nn.Module, enabled: bool = True) -> WeightPages:
    """Move `model`'s large CPU weight storages onto fresh pages, in place (see the module docstring). Call
    once, after the weights are packed: later re-layouts would allocate new, scattered pages again."""
    t0 = time.perf_counter()
    spans = weight_spans(model)
    total = sum(e - s for s, e in spans)
    huge_before = _anon_huge_bytes()

    def skipped(why: str) -> WeightPages:
        return WeightPages(0, total, huge_before, huge_before, time.perf_counter() - t0, why)

    if not enabled:
        return skipped("KVFORGE_WEIGHT_PAGES=0")
    if not sys.platform.startswith("linux"):
        return skipped(f"page placement is Linux-only, this is {sys.platform}")
    if not spans:
        return skipped(f"no CPU weight of {MIN_BYTES >> 10} KiB or more")
    try:
        with open("/proc/self/maps") as f:
            mappings = private_anonymous_ranges(f.read())
    except OSError as e:
        return skipped(f"/proc/self/maps unreadable: {e}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    pieces = []
    for start, end in refault_ranges(spans, mappings):
        lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi > lo:  # a hint: without THP (or with it off) the pages come back as fresh 4 KiB ones
            libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)
        pieces += chunks(start, end)

    def refault(share: list[tuple[int, int]]) -> int:
        """Drop and rewrite each piece through this worker's scratch buffer; ctypes calls release the GIL."""
        scratch, moved = ctypes.create_string_buffer(CHUNK), 0
        for a, b in share:
            ctypes.memmove(scratch, a, b - a)
            if libc.madvise(a, b - a, _MADV_DONTNEED) == 0:
                moved += b - a
            ctypes.memmove(a, scratch, b - a)  # restores the bytes whether or not the pages were dropped
        return moved

    workers = max(1, min(8, torch.get_num_threads(), len(pieces)))
    with ThreadPoolExecutor(workers) as pool:
        moved = sum(pool.map(refault, [pieces[i::workers] for i in range(workers)]))
    return WeightPages(moved, total, huge_before, _anon_huge_bytes(), time.perf_counter() - t0)
