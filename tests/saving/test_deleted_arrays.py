"""A deleted jax.Array in the tree (donated to a jitted function, or ``.delete()``d) is a
ValueError naming its key, raised before anything is written, by tc.save and
CheckpointManager.save, sync and async (issue #39). Before, JAX's raw ``RuntimeError: Array
has been deleted`` came from the plan, or, when an earlier leaf had the same layout, from the
first data write, after the staging area was made."""

import os

import jax.numpy as jnp
import pytest

import tpu_ckpt as tc

WORDS = "Leaf 'params/b' is a deleted jax.Array"


def tree_with_a_deleted_leaf():
    gone = jnp.ones(3)
    gone.delete()
    return {"params": {"a": jnp.arange(3.0), "b": gone}}  # the same layout as "a": the case that slipped past the plan


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
def test_tc_save_names_the_deleted_leaf_and_writes_nothing(tmp_path, enable_async):
    with pytest.raises(ValueError, match=WORDS):
        tc.save(
            tmp_path / "c", tree_with_a_deleted_leaf(), options=tc.CheckpointOptions(enable_async=enable_async)
        ).wait()
    assert not os.path.exists(tmp_path / "c") or os.listdir(tmp_path / "c") == []
    assert os.listdir(tmp_path) in ([], ["c"])


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
def test_a_manager_save_names_the_deleted_leaf_and_writes_no_step(tmp_path, enable_async):
    options = tc.CheckpointOptions(enable_async=enable_async)
    with tc.CheckpointManager(tmp_path / "run", max_to_keep=None, options=options) as manager:
        manager.save(1, {"params": {"a": jnp.arange(3.0), "b": jnp.ones(3)}})
        with pytest.raises(ValueError, match=WORDS):
            manager.save(2, tree_with_a_deleted_leaf())
            manager.wait_until_finished()
    assert manager.all_steps() == [1]
    assert not [name for name in os.listdir(tmp_path / "run") if "2" in name]
