"""`kvforge.gguf_file.GGUFFile` against the `gguf` package's own reader: the same metadata values and the
same tensors (names, types, shapes, offsets, bytes) on the default model's file and on a file written with
every metadata value type; foreign and damaged files are refused with a ValueError."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from kvforge.gguf_file import GGUFFile
from kvforge.models.loader import default_model_path


def same_as_gguf_reader(path: str) -> None:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.data_offset == theirs.data_offset and len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape) and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8))


def test_default_model_file_reads_as_gguf_reads_it():
    same_as_gguf_reader(default_model_path())


def _every_type(path: str) -> str:
    w = GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2 ** 60), w.add_int64("t.i64", -(2 ** 40)), w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo ▁world")
    w.add_array("t.strings", ["a", "", "ü", "<0x0A>"]), w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.ints", [1, -2, 3]), w.add_array("t.bools", [True, False])
    w.add_key_value("t.u8s", [1, 2, 255], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("q8", rng.integers(0, 256, (2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_kind(tmp_path):
    path = _every_type(str(tmp_path / "t.gguf"))
    same_as_gguf_reader(path)
    f = GGUFFile(path)
    assert f.fields["t.str"].contents() == "héllo ▁world" and f.fields["t.u64"].contents() == 2 ** 60
    assert f.fields["t.strings"].contents() == ["a", "", "ü", "<0x0A>"]
    q8 = next(t for t in f.tensors if t.name == "q8")
    assert q8.data.dtype == np.uint8 and q8.data.shape == (2, 34) and list(q8.shape) == [32, 2]


def test_foreign_and_damaged_files_are_refused(tmp_path):
    good = open(_every_type(str(tmp_path / "t.gguf")), "rb").read()
    cases = {
        "magic": b"GGUX" + good[4:],
        "version": good[:4] + (7).to_bytes(4, "little") + good[8:],
        "big-endian": good[:4] + (3).to_bytes(4, "big") + good[8:],
        "truncated header": good[:100],
        "truncated data": good[:-40],
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(data)
        with pytest.raises(ValueError):
            GGUFFile(p)
