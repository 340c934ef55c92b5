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
        with pytest.raises(
            TypeError,
            match=r"args=ocp\.args\.Standard\.\.\.\(x\) is a plain argument here: "
                  r"manager\.save\(step, state\)",
        ):
            manager.save(1, args=ocp.args.StandardSave(state))
        with pytest.raises(TypeError, match=r"needs the tree to save: manager\.save\(step, state\)"):
            manager.save(1)
        assert manager.save(1, state)
        with pytest.raises(TypeError, match=r"manager\.restore\(step, abstract_state\)"):
            manager.restore(1, args=ocp.args.StandardRestore(state))
        np.testing.assert_array_equal(manager.restore(1)["w"], state["w"])


def test_exporting_an_nnx_checkpoint_names_the_keys_it_has(tmp_path):
    """An NNX state saved as {"model": ..., "optimizer": ...} has no 'params': the export's
    error lists the top-level keys, and exporting subtree="model" works."""
    import optax
    from flax import nnx

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tc.save(tmp_path / "nnx", {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}).wait()
    with pytest.raises(
        tc.TargetMismatchError, match=r"subtree 'params' is not in checkpoint .*\['model', 'optimizer'\]: pass one"
    ):
        tc.export_for_serving(tmp_path / "nnx", tmp_path / "serve")
    tc.export_for_serving(tmp_path / "nnx", tmp_path / "serve", subtree="model")
    np.testing.assert_array_equal(tc.restore(tmp_path / "serve")["kernel"]["value"], np.asarray(model.kernel.value))
