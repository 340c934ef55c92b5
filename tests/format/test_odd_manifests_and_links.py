"""Review of the fixes for issues #26 and #29: inputs they still let through (a manifest's
odd but well-formed text, trees a save accepts, a linked checkpoint's source reached
through a link). Real checkpoints on disk, resealed where a manifest is edited."""

import json
import os
import tracemalloc

import jax
import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import as_format_1_2, manifest, write_manifest
from tpu_ckpt.catalog import verify
from tpu_ckpt.format import _decode_json as decode_json

TREE = {"w": np.arange(16, dtype=np.float32), "b": np.ones(3, np.int32)}


@pytest.fixture
def flat(tmp_path):
    """A checkpoint with every piece inline in its manifest (format 1.2), to edit."""
    tc.save(tmp_path / "c", TREE)
    as_format_1_2(tmp_path / "c")
    return tmp_path / "c"


def _edit(path, change) -> None:
    doc = manifest(path)
    change(doc)
    write_manifest(path, doc)


def test_a_format_version_of_non_ascii_digits_is_a_typed_error(flat):
    """Before: ``"1.²"`` passed ``str.isdigit`` and ``int`` raised a bare ValueError."""
    _edit(flat, lambda d: d.update(format_version="1.\u00b2"))
    with pytest.raises(tc.CorruptCheckpointError, match="bad format_version"):
        tc.restore(flat)


def test_a_data_file_name_no_file_system_can_hold_is_a_typed_error(flat):
    """Before: a name holding a lone surrogate reached ``os.open``: UnicodeEncodeError."""
    _edit(flat, lambda d: d["files"][0].__setitem__(0, "\ud800.safetensors"))
    with pytest.raises(tc.CorruptCheckpointError, match="data file name"):
        tc.restore(flat)
    assert not verify(flat).ok


@pytest.mark.parametrize("tree", [
    {"": np.arange(3.0), "a": np.ones(2)},
    {"": np.arange(3.0)},
    {"x": {"": np.arange(3.0), "a": np.ones(2)}},
])
def test_a_dict_key_that_is_the_empty_string_restores(tmp_path, tree):
    """Before: a leaf keyed ``""`` beside others was taken for a root leaf (the whole tree
    one array): the save committed and every restore refused it as damaged."""
    tc.save(tmp_path / "c", tree)
    for restored in (tc.restore(tmp_path / "c"), tc.restore(tmp_path / "c", target=tree)):
        assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(tree)
        pairs = zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(tree))
        assert all(np.array_equal(a, b) for a, b in pairs)
    assert verify(tmp_path / "c").ok


def test_a_root_leaf_beside_other_leaves_is_still_refused(flat):
    def root_leaf(doc):
        leaf = next(e for e in doc["leaves"] if e["key"] == "b")
        leaf.update(key="", path=[])

    _edit(flat, root_leaf)
    with pytest.raises(tc.CorruptCheckpointError, match="both a leaf and a subtree"):
        tc.restore(flat)


def test_a_bool_dict_key_restores(tmp_path):
    """Before: ``{True: x}`` saved the path entry ``["dict", true]``, which the decoder
    refused as not a string: a committed checkpoint no restore could read."""
    tree = {"by_flag": {True: np.arange(3.0), False: np.ones(2)}}
    tc.save(tmp_path / "c", tree)
    restored = tc.restore(tmp_path / "c")["by_flag"]
    assert set(restored) == {True, False} and np.array_equal(restored[True], tree["by_flag"][True])
    assert np.array_equal(tc.restore(tmp_path / "c", target=tree)["by_flag"][False], tree["by_flag"][False])


@pytest.fixture
def runs(tmp_path):
    """A run directory holding a checkpoint and a linked export of it."""
    tc.save(tmp_path / "runs" / "train", TREE)
    tc.export_for_serving(tmp_path / "runs" / "train", tmp_path / "runs" / "served", subtree="", link=True)
    return tmp_path / "runs"


def test_a_linked_checkpoint_follows_no_sibling_linked_out_of_its_directory(runs, tmp_path):
    """Before: a sibling replaced by a link to a checkpoint elsewhere was read through, so
    a linked checkpoint reached outside its parent directory, which linking promises it
    cannot (``export._link``); an export from such a sibling was accepted too."""
    assert np.array_equal(tc.restore(runs / "served")["w"], TREE["w"])
    (tmp_path / "elsewhere").mkdir()
    os.rename(runs / "train", tmp_path / "elsewhere" / "train")
    os.symlink(tmp_path / "elsewhere" / "train", runs / "train")
    with pytest.raises(tc.CorruptCheckpointError, match="the source of linked checkpoint .* outside") as e:
        tc.restore(runs / "served")
    assert e.value.file == str(runs / "train")
    assert not verify(runs / "served").ok
    with pytest.raises(tc.CorruptCheckpointError, match="the source of linked checkpoint .* outside"):
        tc.export_for_serving(runs / "train", runs / "served2", subtree="", link=True)
    assert not os.path.exists(runs / "served2" / "manifest.json")


def test_a_linked_checkpoint_of_a_sibling_link_inside_its_directory_still_reads(runs):
    os.symlink("train", runs / "latest")
    tc.export_for_serving(runs / "latest", runs / "served2", subtree="", link=True)
    assert np.array_equal(tc.restore(runs / "served2")["w"], TREE["w"])
    assert verify(runs / "served2").ok


@pytest.mark.parametrize("unit", [b"[],", b'{"a":1},', b'"ab",', b"1.5,", b"999,", b"[[[0,8]],0,256,64,1688059973],"])
def test_what_a_manifest_takes_decoded_is_known_before_it_is_parsed(unit):
    """Before: only brackets were counted, so 1 GiB (the size bound) of ``{"a":1},`` or
    ``"ab",`` was estimated at a third of what decoding it takes, or nothing: a host with
    the memory the estimate asked for, but less than decoding takes, killed the process."""
    body = b"[" + unit * (2_000_000 // len(unit)) + b"0]"
    tracemalloc.start()
    try:
        json.loads(body)
        taken = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert taken <= decode_json._decoded_bytes(body) <= 2 * taken
