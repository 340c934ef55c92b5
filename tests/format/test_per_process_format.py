"""Hostile per-process values and manifests (#35 item 10): each is a CorruptCheckpointError naming
the key, and nothing proportional to a claimed size is allocated before it is checked."""

import json
import struct

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.format._manifest import seal, unseal
from tpu_ckpt.format._values import decode_value, encode_value


def _encoded(header: object, body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x01", "header runs past"),
        (struct.pack("<Q", 1 << 62) + b"{}", "header runs past"),
        (struct.pack("<Q", 3) + b"{{{", "not JSON"),
        (_encoded(["z", 1]), "not one a value holds"),
        (_encoded(["b", 0, 1 << 40]), "outside its 0 bytes"),
        (_encoded(["b", -1, 1], b"x"), "outside"),
        (_encoded(["a", "float32", [1 << 30, 1 << 30], 0, 4], b"abcd"), "does not hold 4 bytes"),
        (_encoded(["a", "no-such-dtype", [1], 0, 1], b"a"), "no-such-dtype"),
        (_encoded(["d", [[{"k": 1}, ["v", 1]]]]), "dict entry is malformed"),
        (_encoded(["v", [1, 2]]), "malformed"),
        (_encoded(["l", [["l", [["l", []]]]] * 1]), None),
    ],
)
def test_a_damaged_value_is_refused_by_name(data, problem):
    if problem is None:
        assert decode_value(data, "values-00000.bin", "it") == [[[]]]
        return
    with pytest.raises(tc.CorruptCheckpointError, match=problem) as caught:
        decode_value(data, "values-00000.bin", "it")
    assert caught.value.key == "it"


def test_nesting_is_bounded_both_ways():
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(TypeError, match="'it' on process 3 nested deeper than 64"):
        encode_value(deep, "it", 3)
    node: list = ["v", 1]
    for _ in range(100):
        node = ["l", [node]]
    with pytest.raises(tc.CorruptCheckpointError, match="not one a value holds"):
        decode_value(_encoded(node), "values-00000.bin", "it")


def test_values_round_trip_exactly():
    value = {
        "a": [1, 2.5, True, None, "s"], 3: (b"\x00" * 7, np.arange(6, dtype=np.uint16).reshape(2, 3)),
        "nan": float("inf"),
    }
    back = decode_value(encode_value(value, "it", 0), "f", "it")
    assert back["a"] == value["a"] and back["nan"] == float("inf") and back[3][0] == b"\x00" * 7
    np.testing.assert_array_equal(back[3][1], value[3][1])
    assert back[3][1].dtype == np.uint16 and back[3][1].flags.writeable


def _edit(path, change):
    manifest = path / "manifest.json"
    body, _ = unseal(manifest.read_bytes(), where="test")
    doc = json.loads(body)
    change(doc)
    manifest.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))


def _per_process_leaf(doc):
    return next(leaf for leaf in doc["leaves"] if leaf["kind"] == "per_process")


@pytest.fixture
def saved(tmp_path):
    tc.save(tmp_path / "c", {"it": tc.PerProcess({"next_index": 5}), "w": np.arange(4.0)}).wait()
    return tmp_path / "c"


def test_values_missing_for_a_process_are_refused(saved):
    _edit(saved, lambda doc: doc.update(process_count=2))
    with pytest.raises(
        tc.CorruptCheckpointError,
        match=r"'it' does not hold exactly one value for each of the 2 processes that saved it \(1 found\)",
    ):
        tc.restore(saved)


def test_more_values_than_processes_are_refused(saved):
    def three(doc):
        piece = _per_process_leaf(doc)["pieces"][0]
        _per_process_leaf(doc)["pieces"] = [[[[p, p + 1]], *piece[1:]] for p in range(3)]
    _edit(saved, three)
    with pytest.raises(tc.CorruptCheckpointError, match="'it' does not hold exactly one value"):
        tc.metadata(saved)


def test_a_huge_claimed_size_is_refused_before_it_is_read(saved):
    def huge(doc):
        piece = _per_process_leaf(doc)["pieces"][0]
        piece[3] = 1 << 40
        for entry in doc["files"]:
            if entry[0].startswith("values-"):
                entry[1] = (1 << 40) + 64
    _edit(saved, huge)
    with pytest.raises(tc.CorruptCheckpointError, match="values-00000.bin"):
        tc.restore(saved)


def test_a_missing_values_file_and_a_damaged_value_are_named(saved, tmp_path):
    values = saved / "values-00000.bin"
    data = bytearray(values.read_bytes())
    data[-2] ^= 0xFF
    values.write_bytes(bytes(data))
    with pytest.raises(tc.CorruptCheckpointError, match=r"per-process key 'it' saved by process 0 fails its crc32c"):
        tc.restore(saved)
    values.unlink()
    with pytest.raises(tc.CorruptCheckpointError, match="values-00000.bin"):
        tc.restore(saved)


def test_a_bad_logical_type_is_refused(saved):
    def bad(doc):
        next(leaf for leaf in doc["leaves"] if leaf["key"] == "w")["logical"] = "prng_key:../../x"
    _edit(saved, bad)
    with pytest.raises(tc.CorruptCheckpointError, match="logical"):
        tc.metadata(saved)
