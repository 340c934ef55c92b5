"""A damaged or hostile manifest never yields wrong data, a hang or a raw exception.

Each test edits a real checkpoint's manifest the way a bit flip, a bad tool or an adversary
would. Edits are re-sealed (``helpers.sealed``) where the test is about a check behind the
checksum, or written unsealed as a format 1.1 manifest (which had no checksum and is still
read with every other check).
"""

import json
import random

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import as_format_1_2, bits, manifest, sealed, write_manifest
from tpu_ckpt.catalog import verify


def _tree():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    return {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": [np.arange(4, dtype=np.int8), 3.5, "s", None, True],
        "sh": jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x"))),
    }


@pytest.fixture
def ckpt(tmp_path):
    """A format 1.2 checkpoint (pieces inline): these checks are those of formats 1.x, still
    read (format 2's piece tables: tests/format/test_piece_tables.py)."""
    tc.save(tmp_path / "c", _tree())
    as_format_1_2(tmp_path / "c")
    return tmp_path / "c"


def _unsealed_1_1(path, doc):
    """``doc`` written as format 1.1 wrote manifests: no checksum."""
    body = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    (path / "manifest.json").write_text(json.dumps({**body, "format_version": "1.1"}))


def _refused(path, *fragments):
    """Restore, metadata and verify all refuse the checkpoint, naming what is wrong."""
    with pytest.raises(tc.CorruptCheckpointError) as e:
        tc.restore(path)
    for fragment in fragments:
        assert fragment in str(e.value)
    with pytest.raises(tc.CorruptCheckpointError):
        tc.metadata(path)
    report = verify(path)
    assert not report.ok and report.problems[0].kind == "manifest"
    return e.value


def _sh_pieces(doc):
    return next(leaf for leaf in doc["leaves"] if leaf["key"] == "sh")["pieces"]


@pytest.mark.parametrize("sealed_edit", [True, False], ids=["resealed", "format_1_1"])
def test_two_pieces_sharing_bytes_are_refused(ckpt, sealed_edit):
    """Point 1: the second shard of "sh" pointed at the first's file (one bit of its file
    index): each would be read once and checked against one crc, returning the other's bytes."""
    doc = manifest(ckpt)
    first, second = _sh_pieces(doc)
    assert first[1] != second[1] and first[2] == second[2]  # same offset in two files
    second[1] = first[1]
    (write_manifest if sealed_edit else _unsealed_1_1)(ckpt, doc)
    _refused(ckpt, "overlaps another piece")


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda doc: _sh_pieces(doc)[1][0].__setitem__(0, [5, 9]), "outside the leaf's shape"),
        (lambda doc: _sh_pieces(doc)[1][0].__setitem__(0, [3, 7]), "do not tile"),
        (lambda doc: _leaf(doc, "sh")["shape"].__setitem__(0, 9), "do not tile"),
    ],
    ids=["overhang", "gap_and_overlap", "widened_shape"],
)
def test_pieces_that_do_not_tile_their_leaf_are_refused(ckpt, edit, fragment):
    """Point 2: a gap would restore uninitialised memory; an overlap, one block twice."""
    doc = manifest(ckpt)
    edit(doc)
    write_manifest(ckpt, doc)
    _refused(ckpt, fragment, "'sh'")


def test_any_edit_breaks_the_seal(ckpt):
    """Point 3: a change that keeps the manifest valid (a value) is caught by its checksum."""
    path = ckpt / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b"3.5", b"4.5"))
    error = _refused(ckpt, "manifest_crc32c")
    assert error.file == str(path)


def test_a_current_manifest_without_its_seal_is_refused(ckpt):
    doc = manifest(ckpt)
    del doc["manifest_crc32c"]
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    _refused(ckpt, "manifest_crc32c")


def test_format_1_1_manifests_without_a_seal_still_restore(ckpt):
    _unsealed_1_1(ckpt, manifest(ckpt))
    restored = tc.restore(ckpt)
    np.testing.assert_array_equal(restored["sh"], np.arange(8, dtype=np.float32))
    assert verify(ckpt).ok


def _leaf(doc, key):
    return next(leaf for leaf in doc["leaves"] if leaf["key"] == key)


MALFORMED = {
    "infinite_dimension": (lambda d: _leaf(d, "a")["shape"].__setitem__(0, float("inf")), "shape"),
    "offset_2_64": (lambda d: _leaf(d, "a")["pieces"][0].__setitem__(2, 2**64), "offset"),
    "string_length": (lambda d: _leaf(d, "a")["pieces"][0].__setitem__(3, "24"), "length"),
    "bool_file_index": (lambda d: _leaf(d, "a")["pieces"][0].__setitem__(1, True), "file index"),
    "file_index_out_of_range": (lambda d: _leaf(d, "a")["pieces"][0].__setitem__(1, 7), "file index"),
    "missing_key": (lambda d: _leaf(d, "a").pop("dtype"), "dtype"),
    "pieces_not_a_list": (lambda d: _leaf(d, "a").__setitem__("pieces", {"x": 1}), "pieces"),
    "huge_list_index": (lambda d: _leaf(d, "b/1")["path"][1].__setitem__(1, 300_000_000), "path"),
    "claimed_1_tib": (lambda d: _leaf(d, "a").__setitem__("shape", [1 << 38, 1]), "shape"),
    "length_not_elements_times_itemsize": (lambda d: _leaf(d, "a")["pieces"][0].__setitem__(3, 1 << 40), "length"),
    "file_shorter_than_its_pieces": (lambda d: d["files"][0].__setitem__(1, 10), "runs past"),
    "duplicate_key": (lambda d: d["leaves"].append(dict(_leaf(d, "a"))), "appears twice"),
    "leaf_inside_leaf": (
        lambda d: d["leaves"].append(
            {"key": "a/x", "path": [["dict", "a"], ["dict", "x"]], "kind": "value", "value": 1}
        ),
        "both a leaf and a subtree",
    ),
    "key_not_its_path": (lambda d: _leaf(d, "a").__setitem__("key", "z"), "does not match its path"),
    "value_is_a_list": (lambda d: _leaf(d, "b/1").__setitem__("value", [1, 2]), "value"),
    "unknown_kind": (lambda d: _leaf(d, "a").__setitem__("kind", "tensor"), "kind"),
    "absolute_file_name": (lambda d: d["files"][0].__setitem__(0, "/etc/passwd"), "plain relative path"),
    "escaping_file_name": (lambda d: d["files"][0].__setitem__(0, "../../../etc/passwd"), "plain relative path"),
    "source_far_away": (lambda d: d.__setitem__("source", {"path": "../../x", "manifest_crc32c": 1}), "source.path"),
    "nonempty_crc_of_empty_piece": (lambda d: _leaf(d, "a")["pieces"][0].__setitem__(4, 2**33), "crc32c"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_fields_are_typed_errors_naming_the_field(ckpt, name):
    """Point 4: wrong types, out-of-range numbers and inconsistent sizes, each behind a valid
    seal, are refused before anything proportional to a claimed size is allocated."""
    edit, fragment = MALFORMED[name]
    doc = manifest(ckpt)
    edit(doc)
    write_manifest(ckpt, doc)
    error = _refused(ckpt)
    assert fragment in str(error) and error.file == str(ckpt / "manifest.json")


def test_deep_nesting_and_non_json_are_typed_errors(ckpt):
    path = ckpt / "manifest.json"
    path.write_bytes(b'{"format":"tpu_ckpt","format_version":"1.1","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    _refused(ckpt, "not valid JSON")
    path.write_bytes(sealed({"format": "tpu_ckpt", "format_version": "1.2", "files": [], "leaves": "x"}))
    _refused(ckpt, "leaves")


def _flip_cases(data: bytes, count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        bit = rng.randrange(len(data) * 8)
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        yield bit, bytes(flipped)


def test_single_bit_flips_of_a_manifest_never_restore_wrong_data(tmp_path):
    """A seeded fuzz: every single-bit flip of the manifest gives a CheckpointError, or the
    saved data, keys and values bit for bit; and verify fails exactly when restore would not
    return the saved data."""
    tree = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "n": [np.arange(3, dtype=np.int16), 7, "x"]}
    tc.save(tmp_path / "c", tree)
    path = tmp_path / "c" / "manifest.json"
    original = path.read_bytes()
    expected = tc.restore(tmp_path / "c")
    outcomes = {"refused": 0, "same": 0}
    for bit, data in _flip_cases(original, 2000, seed=11):
        path.write_bytes(data)
        try:
            restored = tc.restore(tmp_path / "c")
        except tc.CheckpointError:
            outcomes["refused"] += 1
            assert not verify(tmp_path / "c").ok, f"bit {bit}: restore refused it, verify passed it"
            continue
        outcomes["same"] += 1
        assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(expected), f"bit {bit}"
        for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(expected)):
            assert type(got) is type(want), f"bit {bit}"
            if isinstance(want, np.ndarray):
                assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want)), f"bit {bit}"
            else:
                assert got == want, f"bit {bit}"
    assert outcomes["refused"] >= 1900, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["offset_2_64", "huge_list_index", "infinite_dimension"])
def test_the_command_line_reports_a_malformed_manifest_without_a_traceback(ckpt, name):
    import subprocess
    import sys

    edit, _ = MALFORMED[name]
    doc = manifest(ckpt)
    edit(doc)
    write_manifest(ckpt, doc)
    for command in ("verify", "inspect"):
        result = subprocess.run(
            [sys.executable, "-m", "tpu_ckpt", command, str(ckpt)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode != 0, (command, result.stdout)
        assert "Traceback" not in result.stderr, (command, result.stderr)
        assert "manifest.json" in result.stdout + result.stderr, (command, result.stderr)
