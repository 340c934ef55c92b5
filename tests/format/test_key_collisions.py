"""Two different key paths that join into one checkpoint key, above the leaves too (#26).

A checkpoint names leaves and subtrees by joined strings, so an attribute ``params`` and a
dict key ``'params'`` of one node both become ``params``: their leaves ``params/w`` and
``params/b`` were saved, verify said ok, and a restore without a target rebuilt one
``params`` and lost a leaf. A save now refuses such a tree, naming both paths.
"""

import jax
import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.format import flatten


class _Module:
    """A node holding its ``params`` attribute and, beside it, the entries of its dict of
    extra collections (a dataclass that flattens a dict it holds at its own level)."""

    def __init__(self, params, extras):
        self.params, self.extras = params, extras


jax.tree_util.register_pytree_with_keys(
    _Module,
    lambda m: (
        ((jax.tree_util.GetAttrKey("params"), m.params), *((jax.tree_util.DictKey(k), v) for k, v in m.extras.items())),
        tuple(m.extras),
    ),
    lambda names, children: _Module(children[0], dict(zip(names, children[1:], strict=True))),
)


def test_an_attribute_and_a_dict_key_of_one_name_are_refused_at_save(tmp_path):
    tree = {"model": _Module({"w": np.ones(3)}, {"params": {"b": np.zeros(3)}})}
    with pytest.raises(ValueError, match="both become checkpoint key 'model/params'") as caught:
        tc.save(tmp_path / "ckpt", tree)
    assert "['model' (str)].params" in str(caught.value) and "['model' (str)]['params' (str)]" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_subtrees_whose_keys_differ_only_in_type_are_refused():
    with pytest.raises(ValueError, match="both become checkpoint key '0.1'") as caught:
        flatten({0.1: {"x": np.zeros(1)}, np.float32(0.1): {"y": np.ones(1)}})
    assert "[0.1 (float)]" in str(caught.value) and "(float32)]" in str(caught.value)


def test_a_leaf_and_a_subtree_of_one_name_are_refused():
    with pytest.raises(ValueError, match="both become checkpoint key 'params'"):
        flatten(_Module(np.zeros(2), {"params": {"b": np.ones(2)}}))
    with pytest.raises(ValueError, match="both become checkpoint key 'params'"):
        flatten(_Module({"w": np.zeros(2)}, {"params": np.ones(2)}))


def test_a_tree_whose_keys_differ_saves_and_restores_every_leaf_without_a_target(tmp_path):
    tree = {"model": _Module({"w": np.ones(3)}, {"batch_stats": {"b": np.zeros(3)}}), "step": np.int32(4)}
    tc.save(tmp_path / "ckpt", tree)
    restored = tc.restore(tmp_path / "ckpt")
    assert sorted(restored["model"]) == ["batch_stats", "params"]
    np.testing.assert_array_equal(restored["model"]["params"]["w"], np.ones(3))
    np.testing.assert_array_equal(restored["model"]["batch_stats"]["b"], np.zeros(3))
    assert restored["step"] == 4
