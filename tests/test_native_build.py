"""kvforge/native: the kernel cache key covers every header a source includes, and a library of several
units builds them separately and links them into one object."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvforge import native
from kvforge.attention import cpu_kernel
from kvforge.models import decode_layers, fused, panel_linear
from kvforge.kv import quant_kernel

COMPILER = shutil.which("gcc") or shutil.which("cc")


def _key(sources, include_dirs):
    return native.cache_key(tuple(sources), COMPILER or "cc", ("-O3",), tuple(include_dirs))


@pytest.mark.skipif(COMPILER is None, reason="needs a C compiler")
def test_cache_key_changes_when_a_shared_header_changes(tmp_path):
    """An edited header (included through -I, or through another header) must not load the old object."""
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "outer.h").write_text('#include "inner.h"\n')
    (inc / "inner.h").write_text("static inline int twice(int x) { return 2 * x; }\n")
    src = tmp_path / "unit.c"
    src.write_text('#include <stdint.h>\n#include "outer.h"\nint f(int x) { return twice(x); }\n')
    before = _key([src], [inc])
    assert _key([src], [inc]) == before  # stable
    (inc / "inner.h").write_text("static inline int twice(int x) { return x + x; }\n")
    after = _key([src], [inc])
    assert after != before
    assert native.included_files((src,), (inc,)) == [src.resolve(), (inc / "outer.h").resolve(),
                                                      (inc / "inner.h").resolve()]


def test_every_kernel_includes_the_shared_headers_it_relies_on():
    """Each library's key is taken over the shared headers (kvforge/csrc/include) it includes."""
    shared = {p.name for p in native.INCLUDE_DIR.glob("*.h")}
    assert {"kvf_bf16.h", "kvf_amx.h", "kvf_omp.h"} <= shared
    libs = [cpu_kernel.LIBRARY, fused.LIBRARY, panel_linear.LIBRARY, panel_linear.LIBRARY_BF16,
            decode_layers.LIBRARY, quant_kernel.LIBRARY]
    for lib in libs:
        names = {p.name for p in native.included_files(lib.sources)}
        assert "kvf_omp.h" in names or "kvf_bf16.h" in names, (lib.what, names)
    attention = {p.name for p in native.included_files(cpu_kernel.LIBRARY.sources)}
    assert {"kvf_bf16.h", "kvf_amx.h", "kvf_omp.h"} <= attention


@pytest.mark.skipif(COMPILER is None, reason="needs a C compiler")
def test_a_library_of_several_units_is_linked_into_one_object(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "first.c", tmp_path / "second.c"
    a.write_text('#include "kvf_bf16.h"\nint kvf_test_half(unsigned short x) { return (int)bf16_to_f32(x); }\n')
    b.write_text("int kvf_test_half(unsigned short);\nint kvf_test_call(void) { return kvf_test_half(0x4040); }\n")
    lib = native.NativeLibrary((a, b), None, "a two-unit test library", lambda _lib: None).load()
    assert lib is not None
    assert lib.kvf_test_call() == 3  # 0x4040 is bf16 3.0, across the two units
    broken = tmp_path / "broken.c"
    broken.write_text("int oops( {\n")
    failed = native.NativeLibrary((a, broken), None, "a broken library", lambda _lib: None)
    assert failed.load() is None and "building a broken library failed" in failed.error
    assert not list((tmp_path / "cache" / "kernels").glob(".broken-*"))  # no work folder left behind


@pytest.mark.skipif(COMPILER is None, reason="needs a C compiler")
def test_prebuild_builds_only_what_is_not_cached(tmp_path, monkeypatch):
    """A cold cache: prebuild compiles in the background and a later load() finds the object; a warm one:
    prebuild starts nothing (a warm start loads no library early)."""
    import ctypes

    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "answer.c"
    src.write_text("int kvf_answer(void) { return 42; }\n")

    def declare(lib: ctypes.CDLL) -> None:
        lib.kvf_answer.restype = ctypes.c_int

    cold = native.NativeLibrary(src, None, "a test library", declare)
    assert cold.needs_build()
    for t in native.prebuild(cold):
        t.join()
    assert cold._lib is not None and not cold.needs_build()  # built (and loaded) in the background
    assert cold.load().kvf_answer() == 42
    warm = native.NativeLibrary(src, None, "a test library", declare)  # same source: the object is cached now
    assert not warm.needs_build()
    for t in native.prebuild(warm):
        t.join()
    assert warm._lib is None  # nothing loaded early on a warm start
    assert warm.load().kvf_answer() == 42
