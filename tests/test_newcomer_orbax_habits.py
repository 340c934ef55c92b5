"""Issue #27: Orbax habits on tpu_ckpt's CheckpointManager get a message naming our equivalent."""

import numpy as np
import orbax.checkpoint as ocp
import pytest

import tpu_ckpt as tc


def test_orbax_manager_options_name_the_keywords_that_say_the_same(tmp_path):
    with pytest.raises(TypeError, match=r"CheckpointManagerOptions.*max_to_keep=\.\.\., save_interval_steps=") as e:
        tc.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(max_to_keep=3, save_interval_steps=10))
    assert "enable_async=True" in str(e.value)
    with pytest.raises(TypeError, match="takes a tpu_ckpt.CheckpointOptions, not dict"):
        tc.CheckpointManager(tmp_path, options={"enable_async": True})


def test_orbax_args_on_save_and_restore_name_the_plain_call(tmp_path):
    state = {"w": np.arange(4, dtype=np.float32)}
    with tc.CheckpointManager(tmp_path) as manager:
        with pytest.raises(TypeError, match=r"args=ocp\.args\.Standard\.\.\.\(x\) is a plain argument here: manager\.save\(step, state\)"):
            manager.save(1, args=ocp.args.StandardSave(state))
        with pytest.raises(TypeError, match=r"needs the tree to save: manager\.save\(step, state\)"):
            manager.save(1)
        assert manager.save(1, state)
        with pytest.raises(TypeError, match=r"manager\.restore\(step, abstract_state\)"):
            manager.restore(1, args=ocp.args.StandardRestore(state))
        np.testing.assert_array_equal(manager.restore(1)["w"], state["w"])
