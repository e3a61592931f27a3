"""models/gguf_header: the tensors and scalar metadata of a GGUF file are what the gguf package's
own reader finds (the shipped SmolLM2 file and files written by gguf.GGUFWriter), and a file it
cannot read is refused with its name and what is wrong."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from specsplit.models.gguf_header import GGUFFormatError, GGUFHeader
from specsplit.models.registry import smollm2_gguf_path
from tests.helpers.gguf import NEEDS_GGUF


def same_as_reader(path) -> GGUFHeader:
    """Parse `path` both ways and check every tensor and scalar field agree; returns ours."""
    ours, ref = GGUFHeader(path), gguf.GGUFReader(path)
    assert sorted(ours.tensors) == sorted(t.name for t in ref.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.qtype, info.dims, info.offset, info.nbytes) == \
            (t.tensor_type.name, tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes), t.name
        assert np.array_equal(ours.data(info).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        value = ours.metadata[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert value is None, key
        elif field.types[0] == gguf.GGUFValueType.STRING:
            assert value == bytes(field.parts[field.data[0]]).decode(), key
        else:
            assert value == field.parts[field.data[0]][0], key
    return ours


@NEEDS_GGUF
def test_the_shipped_file_reads_as_the_gguf_package_reads_it():
    ours = same_as_reader(smollm2_gguf_path())
    assert ours.metadata["general.architecture"] == "llama"
    emb = ours.tensors["token_embd.weight"]
    assert emb.dims == (576, 49152) and emb.rows == 49152 and ours.data(emb).shape == (49152, emb.nbytes // 49152)


def write(path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 70000)
    w.add_int64("t.i64", -(2 ** 40))
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", -1.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strings", ["a", "", "ünïcode", "x" * 300])
    w.add_array("t.ints", [1, 2, 3, 4, 5])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_tensor("dense", np.arange(12, dtype=np.float32).reshape(3, 4))
    rng = np.random.default_rng(0)
    q8 = rng.integers(0, 256, size=(4, 2 * 34), dtype=np.uint8)  # 4 rows of 64 Q8_0 values
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("vec", np.ones(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_arrays_and_alignment(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    write(path, alignment)
    ours = same_as_reader(path)
    assert ours.metadata["t.str"] == "héllo" and ours.metadata["t.i64"] == -(2 ** 40)
    assert ours.metadata["t.strings"] is None  # arrays are skipped, not decoded
    q8 = ours.tensors["q8"]
    assert (q8.qtype, q8.dims, q8.rows, ours.data(q8).shape) == ("Q8_0", (64, 4), 4, (4, 68))
    assert ours.tensors["vec"].rows == 1
    if alignment:
        assert all(t.offset % alignment == 0 for t in ours.tensors.values())


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFFormatError, match=r"not\.gguf: not a GGUF file"):
        GGUFHeader(path)
    path.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match=r"not\.gguf: not a GGUF file \(0 bytes\)"):
        GGUFHeader(path)


def test_a_file_cut_short_is_refused(tmp_path):
    path = tmp_path / "t.gguf"
    write(path)
    whole = path.read_bytes()
    info = GGUFHeader(path).tensors["vec"]  # the last tensor
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:info.offset + info.nbytes - 1])  # its last byte missing
    with pytest.raises(GGUFFormatError, match=r"cut\.gguf: tensor 'vec' ends at byte"):
        GGUFHeader(cut)
    cut.write_bytes(whole[:200])  # inside the metadata
    with pytest.raises(GGUFFormatError, match=r"cut\.gguf: .*(ends early|past the end)"):
        GGUFHeader(cut)


@pytest.mark.parametrize("version, message", [((9).to_bytes(4, "little"), "GGUF version 9;"),
                                              ((3).to_bytes(4, "big"), "a big-endian GGUF file")])
def test_an_unknown_version_or_byte_order_is_refused(tmp_path, version, message):
    path = tmp_path / "t.gguf"
    write(path)
    data = bytearray(path.read_bytes())
    data[4:8] = version
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match=message):
        GGUFHeader(path)
