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
    scalars = {"t.u8": GGUFValueType.UINT8, "t.i8": GGUFValueType.INT8, "t.u16": GGUFValueType.UINT16,
               "t.i16": GGUFValueType.INT16, "t.u32": GGUFValueType.UINT32, "t.i32": GGUFValueType.INT32,
               "t.f32": GGUFValueType.FLOAT32, "t.u64": GGUFValueType.UINT64, "t.i64": GGUFValueType.INT64,
               "t.f64": GGUFValueType.FLOAT64, "t.bool": GGUFValueType.BOOL, "t.str": GGUFValueType.STRING}
    values = [200, -5, 60000, -300, 4_000_000_000, -7, 0.1, 2 ** 60, -(2 ** 40), 0.1, True, "héllo ▁world"]
    for (key, vtype), value in zip(scalars.items(), values):
        w.add_key_value(key, value, vtype)
    for key, items in {"t.strings": ["a", "", "ü", "<0x0A>"], "t.floats": [0.5, -1.25, 3.0], "t.ints": [1, -2, 3],
                       "t.bools": [True, False]}.items():
        w.add_array(key, items)
    w.add_key_value("t.u8s", [1, 2, 255], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("q8", rng.integers(0, 256, (2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
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
