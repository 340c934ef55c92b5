import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

from tpu_ckpt import keys


def test_keys_of_a_train_state_follow_the_design_convention():
    params = {"Dense_0": {"kernel": np.zeros((2, 3)), "bias": np.zeros(3)}}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    flat, _ = keys.flatten(state)
    names = [k for k, _, _ in flat]
    assert "params/Dense_0/kernel" in names
    assert "opt_state/0/mu/Dense_0/kernel" in names
    assert "opt_state/0/count" in names
    assert names[0] == "step"


def test_flatten_keeps_none_only_when_asked():
    tree = {"a": None, "b": 1}
    assert [k for k, _, _ in keys.flatten(tree)[0]] == ["b"]
    assert [k for k, _, _ in keys.flatten(tree, keep_none=True)[0]] == ["a", "b"]


def test_slash_in_a_key_is_refused():
    with pytest.raises(ValueError, match="contains '/'"):
        keys.flatten({"a/b": 1})


def test_unflatten_nested_rebuilds_dicts_and_lists():
    tree = {"a": [1, {"b": 2}], "c": {"d": 3}}
    flat, _ = keys.flatten(tree)
    rebuilt = keys.unflatten_nested((entries, leaf) for _, entries, leaf in flat)
    assert rebuilt == tree


def test_unflatten_of_namedtuple_state_uses_attribute_names():
    state = optax.adam(1e-3).init({"w": np.zeros(2)})
    flat, _ = keys.flatten(state)
    rebuilt = keys.unflatten_nested((entries, leaf) for _, entries, leaf in flat)
    assert set(rebuilt[0]) == {"count", "mu", "nu"}
    assert rebuilt[0]["mu"]["w"].shape == (2,)


def test_under():
    assert keys.under("params/w", "params") and keys.under("params", "params")
    assert not keys.under("params2/w", "params")
    assert keys.under("anything", "")


def test_jax_key_path_types_map_to_entry_kinds():
    path = (jax.tree_util.DictKey("a"), jax.tree_util.GetAttrKey("b"), jax.tree_util.SequenceKey(2))
    assert keys.path_entries(path) == [("dict", "a"), ("attr", "b"), ("seq", 2)]
