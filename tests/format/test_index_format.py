"""A process's binary index (#21): what the leader decodes is checked before use; a damaged
or hostile one is a typed error naming the file, never a wrong manifest or a crash."""

import json
import struct

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.format import IndexPlan, LeafEntry, Manifest, PieceEntry, crc32c, decode_index, encode_index
from tpu_ckpt.format._index import MAGIC, row_dtype

WHERE = "/staging/index-00001.bin"
FILE = "d00001-00000.safetensors"
PLANNED = Manifest(
    (
        LeafEntry("w", [["dict", "w"]], "array", (8, 4), "float32"),
        LeafEntry("step", [["dict", "step"]], "value", value=1),
        LeafEntry("s", [["dict", "s"]], "array", (), "int32"),
    ),
    {}, 2, "x",
)
PLAN = IndexPlan.of(PLANNED)
INDEX = Manifest(
    (
        LeafEntry("w", [], "array", pieces=(
            PieceEntry(((4, 8), (0, 4)), FILE, 64, 64, 7), PieceEntry(((0, 4), (0, 4)), FILE, 0, 64, 9),
        )),
        LeafEntry("s", [], "array", pieces=(PieceEntry((), FILE, 128, 4, 3),)),
    ),
    {FILE: 200}, 0, "",
)


def _parts(data):
    """header (dict), rows per rank (structured arrays, writable copies)."""
    length = struct.unpack_from("<I", data, 8)[0]
    header = json.loads(data[16 : 16 + length])
    offset, groups = 16 + length, {}
    for rank, count in header["groups"]:
        groups[rank] = np.frombuffer(data, row_dtype(rank), count, offset).copy()
        offset += count * row_dtype(rank).itemsize
    return header, groups


def _sealed(header, groups, tail=b""):
    """An index as a writer would make it of ``header`` and ``rows``: a valid crc32c, so
    only the checks of its contents stand between it and the merge."""
    text = json.dumps(header).encode()
    body = text + b"".join(rows.tobytes() for rows in groups.values()) + tail
    return MAGIC + struct.pack("<II", len(text), crc32c(body)) + body


def test_an_index_round_trips():
    rows = decode_index(encode_index(INDEX, PLAN), where=WHERE, plan=PLAN)
    assert rows.names == [FILE] and rows.sizes.tolist() == [200] and sorted(rows.groups) == [0, 2]
    w = rows.groups[2]
    assert w["start"].tolist() == [[0, 0], [4, 0]]  # sorted by leaf, then slice
    assert w["offset"].tolist() == [0, 64] and w["crc32c"].tolist() == [9, 7] and w["leaf"].tolist() == [0, 0]
    assert rows.groups[0]["leaf"].tolist() == [2]


def _edit_header(field, value):
    def edit(data):
        header, groups = _parts(data)
        header[field] = value
        return _sealed(header, groups)
    return edit


def _edit_row(rank, field, value, row=0):
    def edit(data):
        header, groups = _parts(data)
        groups[rank][field][row] = value
        return _sealed(header, groups)
    return edit


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: d[:10], "not a tpu_ckpt index"),
        (lambda d: b"X" + d[1:], "not a tpu_ckpt index"),
        (lambda d: d[:-1], "crc32c"),
        (lambda d: d[:-5] + bytes([d[-5] ^ 1]) + d[-4:], "crc32c"),
        (lambda d: d[:8] + struct.pack("<I", 1 << 30) + d[12:], "past the file"),
        (lambda d: _sealed(*_parts(d), tail=b"\0" * 8), "its header says"),
        (_edit_header("format", "other"), "no index format"),
        (_edit_header("files", [[FILE, 200], [FILE, 200]]), "is listed twice"),
        (_edit_header("files", [["../escape", 200]]), "plain relative path"),
        (_edit_header("files", [[FILE, -1]]), "size"),
        (_edit_header("files", "nope"), "not a list of pairs"),
        (_edit_header("groups", [[2, 2], [0, 1]]), "rising rank"),
        (_edit_header("groups", [[65, 0]]), "rank is outside"),
        (_edit_header("groups", [[2, 1 << 40]]), "its header says"),
        (_edit_row(2, "leaf", 7), "leaf past the tree"),
        (_edit_row(2, "leaf", 1), "another rank"),  # the value leaf "step"
        (_edit_row(2, "file", 3), "data file past"),
        (_edit_row(2, "offset", 1 << 63), r"past 2\^63"),
        (_edit_row(2, "stop", [9, 4]), "outside the leaf's shape"),
        (_edit_row(2, "start", [-1, 0]), "outside the leaf's shape"),
        (_edit_row(2, "length", 60), "length other than the slice's bytes"),
        (_edit_row(2, "offset", 150), "past the end of its data file"),
        (_edit_row(2, "offset", 32, row=1), "overlapping bytes"),
    ],
)
def test_a_damaged_index_is_refused_naming_the_file(damage, problem):
    data = damage(encode_index(INDEX, PLAN))
    with pytest.raises(tc.CorruptCheckpointError, match=problem) as caught:
        decode_index(data, where=WHERE, plan=PLAN)
    assert caught.value.file == WHERE and WHERE in str(caught.value)


def test_an_index_of_another_tree_is_refused():
    extra = LeafEntry("extra", [["dict", "extra"]], "value", value=2)
    other = IndexPlan.of(Manifest((*PLANNED.leaves, extra), {}, 2, "x"))
    with pytest.raises(tc.CheckpointError, match="another tree.*same tree") as caught:
        decode_index(encode_index(INDEX, PLAN), where=WHERE, plan=other)
    assert not isinstance(caught.value, tc.CorruptCheckpointError) and caught.value.file == WHERE


def test_a_process_that_wrote_a_key_outside_the_plan_cannot_encode_its_index():
    nope = LeafEntry("nope", [], "array", pieces=(PieceEntry(((0, 1),), FILE, 0, 4, 0),))
    stray = Manifest((nope,), {FILE: 8}, 0, "")
    with pytest.raises(tc.CheckpointError, match="'nope'.*not in the planned tree"):
        encode_index(stray, PLAN)
