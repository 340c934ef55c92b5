"""A re-sealed manifest whose paths reach one node by two different entries (``params`` as an
attribute for one leaf, as a dict entry for another) is a CorruptCheckpointError wherever it
is read (restore, metadata, verify): a tree rebuilt from it would hold one ``params`` and drop
the other's leaves in silence (issue #39)."""

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import manifest, write_manifest
from tpu_ckpt.catalog import verify
from tpu_ckpt.format._keys import node_clash, unflatten_nested

TREE = {"params": {"w": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int32)}}


@pytest.fixture
def clashing(tmp_path):
    path = tmp_path / "c"
    tc.save(path, TREE).wait()
    doc = manifest(path)
    for leaf in doc["leaves"]:
        kind = "attr" if leaf["key"] == "params/w" else "dict"
        leaf["path"] = [[kind, "params"], ["dict", leaf["key"].split("/")[1]]]
    write_manifest(path, doc)
    return path


def test_restore_metadata_and_verify_refuse_a_node_both_attribute_and_dict_entry(clashing):
    words = "key 'params' names two different nodes"
    with pytest.raises(tc.CorruptCheckpointError, match=words) as raised:
        tc.restore(clashing)
    assert raised.value.key == "params"
    with pytest.raises(tc.CorruptCheckpointError, match=words):
        tc.metadata(clashing)
    report = verify(clashing)
    assert not report.ok and words in str(report.problems)


def test_the_paths_of_a_well_formed_tree_do_not_clash():
    paths = [[("attr", "params"), ("dict", "w")], [("attr", "params"), ("dict", "b")], [("seq", 0)]]
    assert node_clash(paths) is None
    assert node_clash([[("seq", 0), ("dict", "w")], [("dict", 0), ("dict", "b")]]) == "0"


@pytest.mark.parametrize(
    "items, words",
    [
        (
            [([("dict", "params")], 1), ([("dict", "params"), ("dict", "w")], 2)],
            "'params' is both a leaf and a subtree",
        ),
        (
            [([("dict", "params"), ("dict", "w")], 2), ([("dict", "params")], 1)],
            "'params' is both a leaf and a subtree",
        ),
        ([([("attr", "p"), ("dict", "w")], 1), ([("dict", "p"), ("dict", "b")], 2)], "both named 'p'"),
    ],
    ids=["leaf then subtree", "subtree then leaf", "attribute and dict entry"],
)
def test_unflattening_paths_that_are_no_tree_is_a_value_error_never_a_lost_leaf(items, words):
    with pytest.raises(ValueError, match=words):
        unflatten_nested(items)
