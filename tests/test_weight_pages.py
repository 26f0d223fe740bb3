"""models/weight_pages.py: which mappings it may drop pages in, how it cuts them, and that the bytes survive."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from kvforge.models.weight_pages import (
    HUGE_PAGE, chunks, merge_spans, private_anonymous_ranges, refault_ranges, settle_weight_pages, weight_spans,
)

MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 08:01 123   /usr/bin/python3.11
55d0c0400000-55d0c0800000 rw-p 00000000 00:00 0     [heap]
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
7f0000400000-7f0000800000 rw-s 00000000 00:05 77    /dev/zero (deleted)
7f0000800000-7f0000c00000 rw-p 00000000 08:01 456   /data/model.safetensors
7f0000c00000-7f0001000000 rw-s 00000000 08:01 457   /data/weights.bin
7f0001000000-7f0001400000 r--p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0     [stack]
"""


def test_only_private_anonymous_writable_mappings_are_candidates() -> None:
    # the heap and a plain anonymous mapping; never a file (shared: the file would change; private: its pages
    # would revert to the file's bytes), shared memory, a read-only mapping or the stack
    assert private_anonymous_ranges(MAPS) == [(0x55d0c0400000, 0x55d0c0800000), (0x7f0000000000, 0x7f0000400000)]


def test_spans_merge_when_they_overlap_or_touch() -> None:
    assert merge_spans([(10, 20), (0, 5), (15, 30), (30, 40), (50, 60)]) == [(0, 5), (10, 40), (50, 60)]


def test_refault_ranges_keep_whole_pages_inside_anonymous_mappings() -> None:
    page = 4096
    maps = [(0, 100 * page), (200 * page, 300 * page)]
    spans = [(10, 5 * page + 7),  # partial first and last pages left out
             (90 * page, 210 * page),  # crosses a gap between mappings: two pieces
             (400 * page, 410 * page)]  # outside every mapping
    assert refault_ranges(spans, maps, page) == [(page, 5 * page), (90 * page, 100 * page), (200 * page, 210 * page)]


@pytest.mark.parametrize("start,end", [(0, 7 * HUGE_PAGE), (4096, 3 * HUGE_PAGE + 8192), (HUGE_PAGE - 4096, HUGE_PAGE),
                                       (5 * 4096, 37 * HUGE_PAGE + 12288)])
def test_chunks_cover_the_range_with_inner_boundaries_on_2mib(start: int, end: int) -> None:
    size = 4 * HUGE_PAGE
    pieces = chunks(start, end, size)
    assert pieces[0][0] == start and pieces[-1][1] == end
    assert all(a < b <= a + size for a, b in pieces)
    assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
    assert all(b % HUGE_PAGE == 0 for _, b in pieces[:-1])


@dataclass(frozen=True)
class _Packed:  # stands in for a PanelWeight / QuantWeight: tensors held as dataclass fields
    codes: torch.Tensor
    n: int


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 512), torch.nn.Linear(512, 4096, bias=False),
                                torch.nn.LayerNorm(512))
    model[1].weight = model[0].weight  # tied, as an lm_head: one storage
    model[1].packed = _Packed(torch.randint(-128, 127, (3 * HUGE_PAGE + 123,), dtype=torch.int8), 1)
    model[2].register_buffer("table", torch.randn(1 << 18))  # a 1 MiB buffer
    return model


def test_weight_spans_see_parameters_buffers_and_packed_fields_once() -> None:
    model = _model()
    spans = weight_spans(model)
    starts = {s for s, _ in spans}
    assert model[0].weight.untyped_storage().data_ptr() in starts
    assert model[1].packed.codes.untyped_storage().data_ptr() in starts
    assert model[2].table.untyped_storage().data_ptr() in starts
    assert model[2].weight.untyped_storage().data_ptr() not in starts  # 2 KiB: left alone
    assert sum(e - s for s, e in spans) == 4096 * 512 * 4 + 3 * HUGE_PAGE + 123 + (1 << 20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page placement is Linux-only")
def test_settling_keeps_every_byte_and_address() -> None:
    model = _model()
    tensors = [model[0].weight, model[1].packed.codes, model[2].table, model[2].weight]
    before = [(t.data_ptr(), t.detach().clone()) for t in tensors]
    report = settle_weight_pages(model)
    assert report.skipped is None
    # nearly every byte: only each storage's partial first and last pages stay
    assert report.weight_bytes - 6 * 4096 <= report.moved_bytes <= report.weight_bytes
    for t, (ptr, old) in zip(tensors, before):
        assert t.data_ptr() == ptr and torch.equal(t.detach(), old)
    assert "moved onto fresh pages" in report.describe()


def test_switched_off_it_moves_nothing() -> None:
    report = settle_weight_pages(_model(), enabled=False)
    assert report.moved_bytes == 0 and "KVFORGE_WEIGHT_PAGES=0" in report.describe()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page placement is Linux-only")
def test_a_file_backed_weight_is_never_dropped(tmp_path) -> None:
    path = tmp_path / "weights.bin"
    data = torch.arange(1 << 20, dtype=torch.float32)
    path.write_bytes(data.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=True, size=1 << 20, dtype=torch.float32)  # MAP_SHARED on the file
    model = torch.nn.Module()
    model.register_buffer("mapped", mapped)
    report = settle_weight_pages(model)
    assert report.weight_bytes == 4 << 20 and report.moved_bytes == 0
    assert torch.equal(mapped, data)
    assert path.read_bytes() == data.numpy().tobytes()


def test_the_engine_reports_its_weight_pages(tiny_model_factory, monkeypatch) -> None:
    from kvforge import LLM

    path, _ = tiny_model_factory()
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", log_ledger=False)
    assert llm.engine.weight_pages is not None
    if sys.platform.startswith("linux"):  # the load moved them (the tiny model's embedding alone is 128 KiB)
        assert llm.engine.weight_pages.moved_bytes > 0 and llm.engine.weight_pages.skipped is None
    assert llm.engine.report.weight_pages == llm.engine.weight_pages.describe()
    monkeypatch.setenv("KVFORGE_WEIGHT_PAGES", "0")
    off = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", log_ledger=False)
    assert off.engine.weight_pages is not None and off.engine.weight_pages.moved_bytes == 0
    assert "KVFORGE_WEIGHT_PAGES=0" in off.engine.report.weight_pages
