import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import tpu_ckpt as tc
from tpu_ckpt.format import flatten, path_entries, under, unflatten_nested


def test_keys_of_a_train_state_follow_the_design_convention():
    params = {"Dense_0": {"kernel": np.zeros((2, 3)), "bias": np.zeros(3)}}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    flat, _ = flatten(state)
    names = [k for k, _, _ in flat]
    assert "params/Dense_0/kernel" in names
    assert "opt_state/0/mu/Dense_0/kernel" in names
    assert "opt_state/0/count" in names
    assert names[0] == "step"


def test_flatten_keeps_none_only_when_asked():
    tree = {"a": None, "b": 1}
    assert [k for k, _, _ in flatten(tree)[0]] == ["b"]
    assert [k for k, _, _ in flatten(tree, keep_none=True)[0]] == ["a", "b"]


def test_slash_in_a_key_is_refused():
    with pytest.raises(ValueError, match="contains '/'"):
        flatten({"a/b": 1})


def test_unflatten_nested_rebuilds_dicts_and_lists():
    tree = {"a": [1, {"b": 2}], "c": {"d": 3}}
    flat, _ = flatten(tree)
    rebuilt = unflatten_nested((entries, leaf) for _, entries, leaf in flat)
    assert rebuilt == tree


def test_unflatten_of_namedtuple_state_uses_attribute_names():
    state = optax.adam(1e-3).init({"w": np.zeros(2)})
    flat, _ = flatten(state)
    rebuilt = unflatten_nested((entries, leaf) for _, entries, leaf in flat)
    assert set(rebuilt[0]) == {"count", "mu", "nu"}
    assert rebuilt[0]["mu"]["w"].shape == (2,)


def test_under():
    assert under("params/w", "params") and under("params", "params")
    assert not under("params2/w", "params")
    assert under("anything", "")


def test_jax_key_path_types_map_to_entry_kinds():
    path = (jax.tree_util.DictKey("a"), jax.tree_util.GetAttrKey("b"), jax.tree_util.SequenceKey(2))
    assert path_entries(path) == [("dict", "a"), ("attr", "b"), ("seq", 2)]


class _Mixed:
    """A pytree node naming one child by dict key '0' and the other by sequence index 0."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    _Mixed,
    lambda m: (((jax.tree_util.DictKey("0"), m.a), (jax.tree_util.SequenceKey(0), m.b)), None),
    lambda _, children: _Mixed(*children),
)


@pytest.mark.parametrize(
    ("tree", "first", "second", "key"),
    [
        ({0.1: np.zeros(2), np.float32(0.1): np.ones(2)}, "[0.1 (float)]", "(float32)]", "'0.1'"),
        ({"opt": [{"w": 1, "v": {np.float16(0.1): 2, 0.1: 3}}]}, "['opt' (str)][0]['v' (str)][0.1 (float)]",
         "(float16)]", "'opt/0/v/0.1'"),
        ({"m": _Mixed(np.zeros(1), np.ones(1))}, "['m' (str)]['0' (str)]", "['m' (str)][0]", "'m/0'"),
    ],
)
def test_colliding_keys_are_refused_naming_both_paths(tree, first, second, key):
    with pytest.raises(ValueError, match="both become checkpoint key") as caught:
        flatten(tree)
    message = str(caught.value)
    assert first in message and second in message and key in message


def test_a_save_with_colliding_keys_writes_nothing(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=r"\[0.1 \(float\)\].*float32.*'a/0.1'"):
        tc.save(target, {"a": {0.1: np.zeros(3), np.float32(0.1): np.ones(3)}})
    assert list(tmp_path.iterdir()) == []


def test_a_restore_into_colliding_keys_is_refused(tmp_path):
    tc.save(tmp_path / "ckpt", {"0.1": np.zeros(3)})
    with pytest.raises(ValueError, match="both become checkpoint key '0.1'"):
        tc.restore(tmp_path / "ckpt", {0.1: np.ones(3), np.float32(0.1): np.ones(3)})
