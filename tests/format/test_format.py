"""The on-disk format: golden safetensors bytes, dtype names, manifest round trip, versions."""

import json

import ml_dtypes
import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import sealed
from tpu_ckpt.format import (
    ALIGNMENT,
    FORMAT_VERSION,
    LeafEntry,
    Manifest,
    PieceEntry,
    PlannedPiece,
    crc32c,
    data_file_bytes,
    decode_manifest,
    dtype_from_name,
    dtype_itemsize,
    dtype_name,
    file_size,
    tensor_name,
)
from tpu_ckpt.format._data_layout import SMALL_PIECE
from tpu_ckpt.format._manifest import DTYPE_NAMES


def piece(key, array):
    return PlannedPiece(key, tuple((0, n) for n in array.shape), array, array.nbytes)


def file_bytes(laid_out) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in laid_out.buffers)


def test_golden_safetensors_header_of_a_two_tensor_shard():
    w, i = np.full((2, 2), 7, np.float32), np.arange(3, dtype=np.int8).astype(ml_dtypes.int4)
    laid_out = data_file_bytes("d.safetensors", [piece("w", w), piece("i", i)])
    header = (
        b'{"__metadata__":{"format":"tpu_ckpt","format_version":"2.0","i[0:3]":"int4"},'
        b'"w[0:2,0:2]":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
        b'"__pad_1":{"dtype":"U8","shape":[48],"data_offsets":[16,64]},'
        b'"i[0:3]":{"dtype":"U8","shape":[3],"data_offsets":[64,67]}}'
    )
    padded = header + b" " * (-(8 + len(header)) % 64)
    written = file_bytes(laid_out)
    base = 8 + len(padded)
    assert written[:base] == len(padded).to_bytes(8, "little") + padded and laid_out.buffers[0] == written[:base]
    assert base % 64 == 0  # the data starts aligned...
    assert [e.offset for e in laid_out.entries] == [base, base + 64]  # ...and so does every tensor
    assert laid_out.size == len(written) == base + 67
    assert written[base : base + 16] == w.tobytes() and written[base + 16 : base + 64] == bytes(48)
    assert written[base + 64 :] == i.tobytes()
    pieces = [("w", ((0, 2), (0, 2)), "float32", (2, 2), 16), ("i", ((0, 3),), "int4", (3,), 3)]
    assert file_size(pieces) == laid_out.size


def test_a_data_file_is_readable_by_the_safetensors_package(tmp_path):
    from safetensors.numpy import load_file

    a = np.arange(5, dtype=np.float32)  # 20 bytes: the next tensor needs padding
    b = np.array([1, 2, 3], dtype=ml_dtypes.bfloat16)
    laid_out = data_file_bytes("f.safetensors", [piece("a", a), piece("b", b)])
    (tmp_path / "f.safetensors").write_bytes(file_bytes(laid_out))
    loaded = load_file(str(tmp_path / "f.safetensors"))
    np.testing.assert_array_equal(loaded["a[0:5]"], a)
    np.testing.assert_array_equal(loaded["b[0:3]"].astype(np.float32), b.astype(np.float32))
    assert set(loaded) == {"a[0:5]", "b[0:3]", "__pad_1"} and not loaded["__pad_1"].any()


def test_a_data_file_of_small_and_big_pieces_is_the_pieces_laid_out(tmp_path):
    """Small pieces are joined with their padding into one buffer, big ones written from
    their own bytes (``SMALL_PIECE``): the file is the same either way, whatever the dtype,
    and each entry points at its piece's bytes with their crc32c."""
    from safetensors.numpy import load_file

    big = SMALL_PIECE // 2 + 8  # elements: over the bound in 2-byte dtypes and up
    arrays = {
        "a": np.arange(5, dtype=np.float32),
        "b": np.arange(big, dtype=np.float32).astype(ml_dtypes.bfloat16),  # big; no buffer protocol export
        "c": np.array(2.5, np.float64),  # 0-d
        "d": np.zeros((0, 3), np.int16),  # no bytes
        "e": np.arange(2 * big, dtype=np.int32)[::2],  # big, not contiguous
        "f": np.array([True, False, True]),
        "g": np.arange(7, dtype=np.int8).astype(ml_dtypes.int4),  # small; no safetensors code
        "h": np.arange(big, dtype=np.uint16),  # big, exported
    }
    pieces = [piece(k, a) for k, a in arrays.items()]
    laid_out = data_file_bytes("d.safetensors", pieces)
    data = file_bytes(laid_out)
    assert len(data) == laid_out.size
    assert laid_out.copied == sum(a.nbytes for a in arrays.values() if a.nbytes <= SMALL_PIECE)
    for (key, array), entry in zip(arrays.items(), laid_out.entries):
        raw = data[entry.offset : entry.offset + entry.length]
        assert entry.offset % ALIGNMENT == 0 and raw == np.ascontiguousarray(array).tobytes(), key
        assert entry.crc32c == crc32c(raw) and entry.slice == pieces[list(arrays).index(key)].slice
    (tmp_path / "d.safetensors").write_bytes(data)
    loaded = load_file(str(tmp_path / "d.safetensors"))
    np.testing.assert_array_equal(loaded[f"h[0:{big}]"], arrays["h"])
    np.testing.assert_array_equal(loaded["a[0:5]"], arrays["a"])


@pytest.mark.parametrize(
    "dtype",
    [
        np.float32, np.int4 if hasattr(np, "int4") else ml_dtypes.int4, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
        np.bool_, np.uint64,
    ],
)
def test_dtype_names_round_trip(dtype):
    assert dtype_from_name(dtype_name(dtype)) == np.dtype(dtype)


def test_unsupported_dtypes():
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        dtype_name(np.dtype(object))
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        dtype_name(np.dtype("U3"))
    with pytest.raises(tc.FormatVersionError, match="unknown"):
        dtype_from_name("float128x")


def _manifest():
    leaves = (
        LeafEntry("params/w", [("dict", "params"), ("dict", "w")], "array", (4, 2), "bfloat16", True,
                      {"type": "NamedSharding", "mesh": {"x": 2}, "spec": ["x"]},
                      (PieceEntry(((0, 2), (0, 2)), "d00000-00000.safetensors", 64, 8, 12345),
                       PieceEntry(((2, 4), (0, 2)), "d00000-00000.safetensors", 80, 8, 54321))),
        LeafEntry("step", [("dict", "step")], "value", value=3),
        LeafEntry("name", [("dict", "name")], "value", value="x"),
        LeafEntry("lr", [("dict", "lr")], "value", value=float("nan")),
    )
    return Manifest(leaves, {"d00000-00000.safetensors": 96}, 2, "desc")


def test_manifest_round_trips():
    m = _manifest()
    back = decode_manifest(m.to_json(), where="m")
    assert back.leaves[:3] == m.leaves[:3]
    assert np.isnan(back.leaves[3].value)
    assert back.files == m.files and back.process_count == 2 and back.sharding_callback == "desc"
    doc = json.loads(m.to_json())
    assert doc["format"] == "tpu_ckpt" and doc["format_version"] == FORMAT_VERSION


def test_minor_versions_are_read_major_versions_refused():
    doc = json.loads(_manifest().to_json())
    doc["format_version"] = "1.7"
    assert decode_manifest(sealed(doc), where="m").version == "1.7"
    doc["format_version"] = "3.0"
    with pytest.raises(tc.FormatVersionError, match="m has format version 3.0"):
        decode_manifest(sealed(doc), where="m")


@pytest.mark.parametrize(
    "data", [b"not json", b"[]", b'{"format": "orbax"}', b'{"format":"tpu_ckpt","format_version":"1.0"}']
)
def test_bad_manifests_are_corrupt_checkpoint_errors(data):
    with pytest.raises(tc.CorruptCheckpointError, match="where"):
        decode_manifest(data, where="where")


def test_crc32c_known_value():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283


def test_tensor_names():
    assert tensor_name("a/b", ((0, 2), (4, 8))) == "a/b[0:2,4:8]"
    assert tensor_name("s", ()) == "s[]"


def test_the_static_dtype_sizes_are_numpys_and_ml_dtypes_own():
    """The table a manifest is sized with, without ml_dtypes, agrees with the dtypes themselves."""
    for name in DTYPE_NAMES:
        assert dtype_itemsize(name) == dtype_from_name(name).itemsize, name
        assert dtype_from_name(name).name == name
    assert dtype_from_name("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert "bfloat16" in DTYPE_NAMES and "float32" in DTYPE_NAMES
