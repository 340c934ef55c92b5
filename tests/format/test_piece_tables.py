"""Format 2: a small manifest holding the tree, and the pieces of gridded leaves in binary
piece tables read per leaf, only when needed, and checked before use (FORMAT.md, "Format 2")."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import as_format_1_2, bits, manifest, write_manifest
from tpu_ckpt import storage
from tpu_ckpt.catalog import verify
from tpu_ckpt.format import (
    ROW,
    LeafEntry,
    Manifest,
    PieceEntry,
    TableSource,
    crc32c,
    decode_manifest,
    encode_manifest,
    piece_columns,
    prefetch,
)
from tpu_ckpt.format._piece_table import grid_of
from tpu_ckpt.format._table_reads import ROW_BYTES


def _tree(mesh42):
    return {
        "sharded": jax.device_put(
            np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh42, P("data", "model"))
        ),
        "rows": jax.device_put(np.arange(32, dtype=np.int32).reshape(8, 4), NamedSharding(mesh42, P("data"))),
        "replicated": jax.device_put(np.arange(6, dtype=np.float32), NamedSharding(mesh42, P())),
        "numpy": np.arange(12, dtype=np.int16).reshape(3, 4),
        "scalar": np.array(2.5, np.float64),
        "jax_scalar": jax.numpy.int32(7),
        "bf16": np.arange(10).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), np.float32),
        "value": 3,
        "text": "x",
    }


@pytest.fixture
def ckpt(tmp_path, mesh42):
    tree = _tree(mesh42)
    tc.save(tmp_path / "c", tree)
    return tmp_path / "c", tree


def _leaf_doc(doc, key):
    return next(e for e in doc["leaves"] if e["key"] == key)


def test_round_trip_and_layout(ckpt):
    path, tree = ckpt
    doc = manifest(path)
    assert doc["format_version"] == "2.0"
    assert doc["tables"] == [["pieces-00000.bin", os.path.getsize(path / "pieces-00000.bin")]]
    sharded = _leaf_doc(doc, "sharded")
    assert "pieces" not in sharded and sharded["grid"] == [2, 4]
    assert sharded["table"][2] == 8
    assert _leaf_doc(doc, "scalar")["grid"] == [] and _leaf_doc(doc, "scalar")["table"][2] == 1
    assert _leaf_doc(doc, "empty")["pieces"]  # a zero-size leaf is no grid: its piece stays inline
    rows = sum(e["table"][2] for e in doc["leaves"] if "table" in e)
    assert os.path.getsize(path / "pieces-00000.bin") == 16 * rows
    restored = tc.restore(path)
    for key, value in tree.items():
        if isinstance(value, (int, str)):
            assert restored[key] == value
        else:
            assert np.asarray(restored[key]).dtype == np.asarray(value).dtype
            np.testing.assert_array_equal(bits(restored[key]), bits(value))
    assert verify(path).ok


def test_restore_onto_the_saved_sharding(ckpt, mesh42):
    path, tree = ckpt
    target = {k: v for k, v in tree.items() if isinstance(v, jax.Array) and v.ndim}
    restored = tc.restore(path, target)
    for key, value in target.items():
        assert restored[key].sharding == value.sharding
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(value))


def test_metadata_reads_no_table(ckpt):
    path, tree = ckpt
    os.remove(path / "pieces-00000.bin")
    meta = tc.metadata(path)
    assert meta["sharded"].shape == (8, 8) and meta["bf16"].dtype == ml_dtypes.bfloat16
    assert meta["value"] == 3
    with pytest.raises(tc.CorruptCheckpointError) as e:
        tc.restore(path)
    assert "pieces-00000.bin" in str(e.value)


def test_a_one_leaf_restore_reads_only_its_rows(ckpt):
    """Every byte of the table but this leaf's rows is overwritten: a restore of the leaf
    still succeeds (it read nothing else), and a full restore, which reads the rest, fails."""
    path, tree = ckpt
    t, row, count, _ = _leaf_doc(manifest(path), "rows")["table"]
    table = path / "pieces-00000.bin"
    data = bytearray(table.read_bytes())
    rows = data[16 * row : 16 * (row + count)]
    data[:] = b"\xff" * len(data)
    data[16 * row : 16 * (row + count)] = rows
    table.write_bytes(bytes(data))
    restored = tc.restore(path, subtree="rows")
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(tree["rows"]))
    with pytest.raises(tc.CorruptCheckpointError, match="pieces-00000.bin"):
        tc.restore(path)


def test_format_1_2_still_restores(ckpt):
    path, tree = ckpt
    as_format_1_2(path)
    assert manifest(path)["format_version"] == "1.2" and not os.path.exists(path / "pieces-00000.bin")
    restored = tc.restore(path)
    np.testing.assert_array_equal(np.asarray(restored["sharded"]), np.asarray(tree["sharded"]))
    assert verify(path).ok


def test_a_flipped_bit_in_a_table_names_the_table_and_the_key(ckpt):
    path, _ = ckpt
    doc = manifest(path)
    t, row, count, _ = _leaf_doc(doc, "rows")["table"]
    table = path / "pieces-00000.bin"
    data = bytearray(table.read_bytes())
    data[16 * row + 3] ^= 0x10
    table.write_bytes(bytes(data))
    assert tc.metadata(path)["rows"].shape == (8, 4)  # the tree is intact
    with pytest.raises(tc.CorruptCheckpointError) as e:
        tc.restore(path)
    assert "crc32c" in str(e.value) and "'rows'" in str(e.value) and e.value.key == "rows"
    assert e.value.file == str(table)
    tc.restore(path, subtree="sharded")  # another leaf's rows are sound
    report = verify(path)
    assert not report.ok and report.problems[0].kind == "manifest" and report.problems[0].where == str(table)


def _rewrite_rows(path, key, edit):
    """Edits ``key``'s rows and reseals the manifest with their new crc32c, so what is
    tested is the row check behind the checksum."""
    doc = manifest(path)
    entry = _leaf_doc(doc, key)
    t, row, count, _ = entry["table"]
    table = path / doc["tables"][t][0]
    data = bytearray(table.read_bytes())
    rows = np.frombuffer(bytes(data[16 * row : 16 * (row + count)]), ROW).copy()
    edit(rows, doc)
    data[16 * row : 16 * (row + count)] = rows.tobytes()
    table.write_bytes(bytes(data))
    entry["table"][3] = crc32c(rows.tobytes())
    write_manifest(path, doc)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda rows, doc: rows["file"].__setitem__(1, len(doc["files"])), "file index"),
        (lambda rows, doc: rows["offset"].__setitem__(1, 1 << 62), "offset"),
        (lambda rows, doc: rows["offset"].__setitem__(1, 1 << 63), "offset"),
        (
            lambda rows, doc: (
                rows["offset"].__setitem__(1, rows["offset"][0]), rows["file"].__setitem__(1, rows["file"][0])
            ),
            "overlapping",
        ),
    ],
    ids=["file_index", "offset_past_file", "offset_past_2_63", "two_rows_same_bytes"],
)
def test_bad_rows_are_typed_errors(ckpt, edit, fragment):
    path, _ = ckpt
    _rewrite_rows(path, "sharded", edit)
    tc.metadata(path)
    with pytest.raises(tc.CorruptCheckpointError) as e:
        tc.restore(path, subtree="sharded")
    assert fragment in str(e.value) and e.value.key == "sharded"
    assert not verify(path).ok


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda e: e["grid"].__setitem__(0, 3), "cells"),
        (lambda e: e["grid"].__setitem__(0, 0), "step"),
        (lambda e: e["grid"].__setitem__(0, 9), "step"),
        (lambda e: e["grid"].__setitem__(0, True), "grid"),
        (lambda e: e["grid"].__setitem__(0, [0, 2, 4, 8]), "cells"),
        (lambda e: e["grid"].__setitem__(0, [0, 2, 4, 6, 9]), "grid"),
        (lambda e: e["grid"].__setitem__(0, [0, 4, 2, 6, 8]), "rise"),
        (lambda e: e["grid"].pop(), "grid"),
        (lambda e: e["table"].__setitem__(1, 10_000), "past"),
        (lambda e: e["table"].__setitem__(0, 3), "table index"),
        (lambda e: e["table"].__setitem__(2, 9), "cells"),
        (lambda e: e.__setitem__("pieces", []), "both"),
    ],
    ids=["step_count", "step_0", "step_past_shape", "bool_step", "fewer_cuts", "cut_past_shape", "cuts_not_rising",
         "rank", "rows_past_table", "no_such_table", "count", "pieces_and_table"],
)
def test_bad_grids_and_references_are_typed_errors(ckpt, edit, fragment):
    path, _ = ckpt
    doc = manifest(path)
    edit(_leaf_doc(doc, "sharded"))
    write_manifest(path, doc)
    with pytest.raises(tc.CorruptCheckpointError) as e:
        tc.metadata(path)
    assert fragment in str(e.value) and "'sharded'" in str(e.value)


def test_a_format_1_manifest_with_tables_is_refused(ckpt):
    path, _ = ckpt
    write_manifest(path, {**manifest(path), "format_version": "1.2"})
    with pytest.raises(tc.CorruptCheckpointError, match="format 2"):
        tc.metadata(path)


def test_moved_cut_points_are_refused_on_read(ckpt):
    """Cut points moved but as many cells: the pieces' lengths change, so their bytes no
    longer match their crc32c (or overlap) and the read is refused."""
    path, _ = ckpt
    doc = manifest(path)
    _leaf_doc(doc, "sharded")["grid"][0] = [0, 3, 4, 6, 8]
    write_manifest(path, doc)
    with pytest.raises(tc.CorruptCheckpointError):
        tc.restore(path, subtree="sharded")


def test_two_leaves_aliasing_the_same_bytes(ckpt):
    """A leaf's rows pointed at another leaf's bytes: a restore of it alone reads them and
    refuses them by its own crc32c; a full restore and verify see the shared bytes."""
    path, _ = ckpt
    doc = manifest(path)
    src = _leaf_doc(doc, "sharded")  # pieces of 32 bytes, as those of "rows"
    t, row, _, _ = src["table"]
    raw = (path / "pieces-00000.bin").read_bytes()
    other_row = np.frombuffer(raw[16 * row : 16 * row + 16], ROW)

    def alias(rows, _doc):
        rows["file"][0], rows["offset"][0] = other_row["file"][0], other_row["offset"][0]

    _rewrite_rows(path, "rows", alias)
    with pytest.raises(tc.CorruptCheckpointError):
        tc.restore(path, subtree="rows")  # crc32c of the piece
    with pytest.raises(tc.CorruptCheckpointError) as e:
        tc.restore(path)
    assert "overlaps another piece" in str(e.value)
    assert not verify(path).ok


def test_grid_of():
    def pieces(*slices):
        return [PieceEntry(s, "f", 0, 1, 0) for s in slices]

    assert grid_of((4, 4), pieces(((0, 2), (0, 4)), ((2, 4), (0, 4)))) == ([[0, 2, 4], [0, 4]], [0, 1])
    assert grid_of((4, 4), pieces(((2, 4), (0, 4)), ((0, 2), (0, 4)))) == ([[0, 2, 4], [0, 4]], [1, 0])
    assert grid_of((), pieces(())) == ([], [0])
    # an L-shaped split (a guillotine cut of one block) is no grid: it stays inline
    assert grid_of((4, 4), pieces(((0, 2), (0, 4)), ((2, 4), (0, 2)), ((2, 4), (2, 4)))) is None
    assert grid_of((0, 4), pieces(((0, 0), (0, 4)))) is None


def test_control_bytes_per_piece(tmp_path):
    """A leaf of many small pieces costs 16 bytes of table per piece, and a few bytes of JSON
    per grid cut."""
    n = 4096
    pieces = [PieceEntry(((i * 4, i * 4 + 4),), "d00000-00000.safetensors", 64 * i, 16, 1) for i in range(n)]

    leaf = LeafEntry("w", [("dict", "w")], "array", (4 * n,), "float32", False, None, tuple(pieces))
    body, tables = encode_manifest(Manifest((leaf,), {"d00000-00000.safetensors": 64 * n}, 1, "x"))
    assert sum(map(len, tables.values())) == 16 * n
    assert (len(body) + 16 * n) / n <= 24
    doc = json.loads(body)
    assert doc["leaves"][0]["table"][:3] == [0, 0, n]


def _recorded_manifest(path) -> tuple[object, list[tuple[str, int, int]]]:
    """The manifest at ``path`` decoded over its real piece tables, with every table read recorded."""
    reads: list[tuple[str, int, int]] = []

    def read(name: str, start: int, length: int) -> bytes:
        reads.append((name, start, length))
        with open(path / name, "rb") as f:
            f.seek(start)
            return f.read(length)

    data = (path / "manifest.json").read_bytes()
    return decode_manifest(data, where=str(path), tables=TableSource(read, storage.location(path).child)), reads


def test_the_rows_of_many_leaves_are_read_in_runs(tmp_path):
    """A tree of small leaves has a row or two per leaf, side by side in one table: a restore
    reads them in one request, not one per leaf (a thousand leaves cost a thousand round trips
    on an object store), and a few scattered leaves read at most twice their own rows."""
    tree = {f"l{i:03d}": np.full((4,), i, np.float32) for i in range(300)}
    tc.save(tmp_path / "c", tree).wait()
    everything, reads = _recorded_manifest(tmp_path / "c")
    prefetch(everything.leaves, threads=4)
    assert len(reads) == 1 and reads[0][2] == 300 * ROW_BYTES
    assert [p.crc32c for leaf in everything.leaves for p in leaf.pieces] == [crc32c(v.tobytes()) for v in tree.values()]

    some, reads = _recorded_manifest(tmp_path / "c")
    wanted = [leaf for leaf in some.leaves if leaf.key in ("l000", "l001", "l002", "l150", "l299")]
    prefetch(wanted, threads=4)
    assert len(reads) == 3 and sum(length for _, _, length in reads) == 5 * ROW_BYTES
    assert all(p.crc32c == crc32c(tree[leaf.key].tobytes()) for leaf in wanted for p in leaf.pieces)
    restored = tc.restore(tmp_path / "c")
    assert all(np.array_equal(restored[k], v) for k, v in tree.items())


def test_rows_kept_as_pieces_give_the_same_columns_without_a_second_read(ckpt):
    """#39: once a leaf's pieces are built from its rows, the rows' columns are let go of (a
    state of many small leaves holds one set per leaf); the columns asked for afterwards are
    the same, made from the pieces, and no table is read again."""
    path, _ = ckpt
    decoded, reads = _recorded_manifest(path)
    leaf = next(leaf for leaf in decoded.leaves if leaf.key == "sharded")
    prefetch([leaf], threads=1)
    before = [np.copy(c) for c in piece_columns(leaf)[1:]]
    names = piece_columns(leaf)[0]
    pieces = list(leaf.pieces)  # builds them
    assert len(pieces) == 8 and len(reads) == 1
    after = piece_columns(leaf)
    assert after[0] == names and all(np.array_equal(a, b) for a, b in zip(after[1:], before))
    assert [names[f] for f in after[1].tolist()] == [p.file for p in pieces] and len(reads) == 1
