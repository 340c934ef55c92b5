"""Typed PRNG keys are leaves: saved as key data plus their impl's name, restored as typed keys
of that impl, bit-exact, onto the saved sharding or another mesh; old-style uint32 keys stay arrays."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc


def _data(key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_a_typed_key_of_any_impl_comes_back_typed_and_bit_exact(tmp_path, impl):
    key = jax.random.key(42, impl=impl)
    keys = jax.random.split(key, 8)
    tc.save(tmp_path / "c", {"rng": key, "keys": keys, "old": jax.random.PRNGKey(7)}).wait()
    back = tc.restore(tmp_path / "c")  # no target: typed keys too
    assert back["rng"].dtype == key.dtype and back["keys"].dtype == keys.dtype
    np.testing.assert_array_equal(_data(back["rng"]), _data(key))
    np.testing.assert_array_equal(_data(back["keys"]), _data(keys))
    assert back["old"].dtype == np.uint32 and back["old"].shape == (2,)  # an old-style key stays a plain array
    np.testing.assert_array_equal(back["old"], np.asarray(jax.random.PRNGKey(7)))
    assert tc.metadata(tmp_path / "c")["rng"].logical == f"prng_key:{impl}"
    # the restored key draws what the saved one draws
    np.testing.assert_array_equal(jax.random.normal(back["rng"], (4,)), jax.random.normal(key, (4,)))


def test_a_sharded_key_restores_onto_another_mesh(tmp_path):
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P("x")))
    replicated = jax.device_put(jax.random.key(2), NamedSharding(mesh, P()))
    tc.save(tmp_path / "c", {"keys": keys, "replicated": replicated}).wait()
    other = jax.sharding.Mesh(np.array(devices[::-1]).reshape(-1, 1), ("a", "b"))
    target = {
        "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=NamedSharding(other, P("a"))),
        "replicated": jax.random.key(0),  # a typed key as the target: its sharding, the saved key
    }
    back = tc.restore(tmp_path / "c", target)
    assert back["keys"].dtype == keys.dtype and back["keys"].sharding == target["keys"].sharding
    np.testing.assert_array_equal(_data(back["keys"]), _data(keys))
    np.testing.assert_array_equal(_data(back["replicated"]), _data(jax.random.key(2)))


def test_nnx_rng_state_saves_whole(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    state = nnx.state(model)
    tc.save(tmp_path / "c", state).wait()
    back = tc.restore(tmp_path / "c", state)
    saved_keys = [x for x in jax.tree_util.tree_leaves(state) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    back_keys = [x for x in jax.tree_util.tree_leaves(back) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    assert saved_keys and len(back_keys) == len(saved_keys)
    for a, b in zip(saved_keys, back_keys):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(_data(a), _data(b))


def test_a_key_target_of_another_shape_or_impl_is_refused_and_a_plain_one_gets_the_key_data(tmp_path):
    """The target decides, as for any leaf: a typed key target of another shape or impl than
    the saved keys is a TargetMismatchError naming the leaf (restore and check_restore alike);
    a plain uint32 target gets the key data."""
    keys = jax.random.split(jax.random.key(0), 4)
    tc.save(tmp_path / "c", {"k": keys, "w": np.zeros(4, np.float32)}).wait()
    with pytest.raises(tc.TargetMismatchError, match="'k' has shape"):
        tc.restore(tmp_path / "c", {"k": jax.random.split(jax.random.key(0), 3)})
    other = {"k": jax.random.split(jax.random.key(0, impl="rbg"), 4)}
    with pytest.raises(tc.TargetMismatchError, match="'k': a key<rbg> target, saved as threefry2x32 keys"):
        tc.restore(tmp_path / "c", other)
    report = tc.check_restore(tmp_path / "c", other)
    assert not report.ok and "saved as threefry2x32 keys" in report.problems[0], report.problems
    data = tc.restore(tmp_path / "c", {"k": np.zeros((4, 2), np.uint32)})["k"]
    assert isinstance(data, np.ndarray) and data.dtype == np.uint32
    np.testing.assert_array_equal(data, np.asarray(jax.random.key_data(keys)))
    assert jax.dtypes.issubdtype(tc.restore(tmp_path / "c")["k"].dtype, jax.dtypes.prng_key)
