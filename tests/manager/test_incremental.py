"""CheckpointManager(incremental=True): a LoRA-style loop writes only what changed, every kept
step restores bit-exactly after retention, and references between steps are confined."""

import json
import os
import shutil
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tpu_ckpt as tc
from tests.manager import incremental_kill_worker
from tests.support import process_group
from tpu_ckpt.catalog import verify
from tpu_ckpt.cli import main

LAYERS, WIDTH, RANK = 4, 512, 4


class Base(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = nn.Dense(WIDTH, name=f"dense_{i}")(x)
        return x


def lora_setup():
    """Frozen base params, a LoRA adapter per layer and its Adam state."""
    base = Base().init(jax.random.key(0), jnp.ones((1, WIDTH)))["params"]
    keys = jax.random.split(jax.random.key(1), LAYERS)
    adapter = {
        f"dense_{i}": {"a": jax.random.normal(k, (WIDTH, RANK)) * 0.01, "b": jnp.zeros((RANK, WIDTH))}
        for i, k in enumerate(keys)
    }
    return base, adapter


def forward(base, adapter, x):
    for i in range(LAYERS):
        layer, lora = base[f"dense_{i}"], adapter[f"dense_{i}"]
        x = x @ layer["kernel"] + layer["bias"] + (x @ lora["a"]) @ lora["b"]
    return x


def nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree) if hasattr(leaf, "nbytes"))


def written(step_dir) -> int:
    """Bytes of the files a save wrote into its own step directory (data files and piece tables)."""
    return sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir) if f != "manifest.json")


def run_loop(directory, incremental: bool, steps: int = 5, max_to_keep: int = 2):
    base, adapter = lora_setup()
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(adapter)
    x = jax.random.normal(jax.random.key(2), (8, WIDTH))

    @jax.jit
    def train_step(adapter, opt_state):
        grads = jax.grad(lambda a: jnp.mean(forward(base, a, x) ** 2))(adapter)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(adapter, updates), opt_state

    states, sizes = {}, {}
    with tc.CheckpointManager(directory, max_to_keep=max_to_keep, incremental=incremental) as manager:
        for step in range(steps):
            adapter, opt_state = train_step(adapter, opt_state)
            state = {"base": base, "adapter": adapter, "opt": opt_state, "step": step}
            manager.save(step, state)
            states[step] = jax.tree.map(np.asarray, state)
            sizes[step] = written(os.path.join(directory, f"step_{step}"))
    return states, sizes, nbytes(adapter) + nbytes(opt_state)


def assert_bit_exact(restored, expected):
    flat_r, flat_e = jax.tree.leaves(restored), jax.tree.leaves(expected)
    assert len(flat_r) == len(flat_e)
    for r, e in zip(flat_r, flat_e):
        np.testing.assert_array_equal(np.asarray(r), np.asarray(e), strict=True)


def test_lora_loop_writes_only_the_adapter_and_every_kept_step_restores(tmp_path):
    states, sizes, trained = run_loop(tmp_path / "inc", incremental=True)
    _, full_sizes, _ = run_loop(tmp_path / "full", incremental=False)
    for step in range(1, 5):
        assert sizes[step] <= 1.05 * trained, (step, sizes[step], trained)
        assert full_sizes[step] > 10 * trained  # the base is ≥ 10x the adapter and its state
    assert sorted(os.listdir(tmp_path / "inc")) == ["step_0", "step_3", "step_4"]
    assert os.listdir(tmp_path / "inc" / "step_0") != []
    assert not (tmp_path / "inc" / "step_0" / "manifest.json").exists()
    manager = tc.CheckpointManager(tmp_path / "inc", incremental=True)
    assert manager.all_steps() == [3, 4]
    for step in (3, 4):
        assert_bit_exact(manager.restore(step), states[step])
        report = verify(str(tmp_path / "inc" / f"step_{step}"))
        assert report.ok and report.nbytes >= nbytes(states[step]["base"]), report.problems


def test_a_retired_step_goes_once_no_kept_step_references_it(tmp_path):
    base = {"w": np.arange(64, dtype=np.float32)}
    with tc.CheckpointManager(tmp_path, max_to_keep=1, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
        assert sorted(os.listdir(tmp_path / "step_0")) == ["d00000-00000.safetensors", "referenced.json"]
        manager.save(2, {"base": {"w": np.zeros(64, np.float32)}, "t": np.ones(4, np.float32)})
        assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]  # step 2 references step 1's "t"
        assert "referenced.json" in os.listdir(tmp_path / "step_1")
        assert manager.all_steps() == [2]
        np.testing.assert_array_equal(manager.restore(2)["t"], np.ones(4, np.float32))
        manager.save(3, {"base": {"w": np.ones(64, np.float32)}, "t": np.zeros(4, np.float32)})
        assert sorted(os.listdir(tmp_path)) == ["step_3"]
        assert manager.all_steps() == [3]


def test_a_numpy_array_changed_in_place_is_written_again(tmp_path):
    w = np.arange(16, dtype=np.float32)
    with tc.CheckpointManager(tmp_path, max_to_keep=None, incremental=True) as manager:
        manager.save(0, {"w": w})
        w[3] = -1.0  # the same object, other bytes: the digest tells
        manager.save(1, {"w": w})
        manager.save(2, {"w": w})
        files = {s: json.loads(_manifest(tmp_path / f"step_{s}"))["files"] for s in (1, 2)}
        assert [name for name, _ in files[1]] == ["d00000-00000.safetensors"]
        assert [name for name, _ in files[2]] == ["../step_1/d00000-00000.safetensors"]
        np.testing.assert_array_equal(manager.restore(2)["w"], w)
        np.testing.assert_array_equal(manager.restore(0)["w"], np.arange(16, dtype=np.float32))


def test_a_deleted_referenced_file_fails_the_restore_naming_it(tmp_path):
    base = {"w": np.arange(64, dtype=np.float32)}
    with tc.CheckpointManager(tmp_path, max_to_keep=None, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
    os.remove(tmp_path / "step_0" / "d00000-00000.safetensors")
    with pytest.raises(tc.CheckpointError, match="step_0/d00000-00000.safetensors"):
        tc.restore(str(tmp_path / "step_1"))


def _manifest(step_dir) -> str:
    data = (step_dir / "manifest.json").read_text()
    return data


def test_cli_gc_verify_diff_export_follow_references(tmp_path, capsys):
    base = {"w": np.arange(4096, dtype=np.float32)}
    with tc.CheckpointManager(tmp_path / "run", max_to_keep=1, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
    run = tmp_path / "run"
    assert main(["gc", str(run)]) == 0
    assert sorted(os.listdir(run / "step_0")) == ["d00000-00000.safetensors", "referenced.json"]  # referenced: kept
    assert main(["verify", str(run / "step_1")]) == 0
    assert main(["diff", "--values", str(run / "step_1"), str(run / "step_1")]) == 0
    assert main(["export", "--subtree", "base", str(run / "step_1"), str(tmp_path / "serving")]) == 0
    np.testing.assert_array_equal(tc.restore(str(tmp_path / "serving"))["w"], base["w"])
    assert main(["export-orbax", str(run / "step_1"), str(tmp_path / "orbax")]) == 0
    assert main(["import-orbax", str(tmp_path / "orbax"), str(tmp_path / "back")]) == 0
    np.testing.assert_array_equal(tc.restore(str(tmp_path / "back"))["base"]["w"], base["w"])
    assert main(["ls", str(run)]) == 0
    assert "step_0" not in capsys.readouterr().out


def test_sigkill_during_incremental_saves_and_retention_leaves_every_kept_step_restorable(tmp_path):
    """Kills the loop at varied moments (in a save, in its retention), restarts it, and
    checks after each kill that every listed step restores bit-exactly."""
    worker = os.path.join(os.path.dirname(__file__), "incremental_kill_worker.py")
    expected_base = incremental_kill_worker.frozen()
    for kill in range(3):
        proc = subprocess.Popen([sys.executable, worker, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        try:
            saved = [proc.stdout.readline() for _ in range(2 + kill)]
            assert all(line.startswith("SAVED") for line in saved), saved
            time.sleep(0.02 * kill)  # a later moment of the next save (or its retention) each time
        finally:
            proc.kill()
            proc.wait()
        manager = tc.CheckpointManager(tmp_path, max_to_keep=2)
        steps = manager.all_steps()
        assert steps, kill
        for step in steps:
            restored = manager.restore(step)
            assert_bit_exact(restored["base"], expected_base)
            assert_bit_exact(restored["trained"], incremental_kill_worker.trained(step))
        assert main(["verify", str(tmp_path / f"step_{steps[-1]}")]) == 0


@pytest.mark.parametrize("io_device", [False, True])
def test_two_processes_save_incrementally(tmp_path, io_device):
    code = os.path.join(os.path.dirname(__file__), "incremental_mp_code.py")
    if io_device:
        (tmp_path / "io_device").write_text("")
    results = process_group.run("exec_file", 2, str(tmp_path), code)
    assert all(r.returncode == 0 for r in results), [r.output[-3000:] for r in results]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == [2, 3]
    trained_bytes = 64 * 8 * 4
    assert all(result["written"][str(step)] < trained_bytes + 4096 for step in (1, 2, 3)), result
    assert result["written"]["0"] > 64 * 1024 * 4


def test_async_incremental_saves_restore_and_skip_the_frozen_part(tmp_path):
    base = jnp.arange(4096, dtype=jnp.float32)
    options = tc.CheckpointOptions(enable_async=True)
    with tc.CheckpointManager(tmp_path, max_to_keep=2, incremental=True, options=options) as manager:
        for step in range(4):
            manager.save(step, {"base": base, "t": jnp.full((8,), step, jnp.float32)})
        manager.wait_until_finished()
        assert written(tmp_path / "step_3") < 4096
        for step in manager.all_steps():
            restored = manager.restore(step)
            np.testing.assert_array_equal(restored["base"], np.arange(4096, dtype=np.float32))
            np.testing.assert_array_equal(restored["t"], np.full((8,), step, np.float32))


def test_a_new_jax_array_is_not_taken_for_the_saved_one_it_replaced(tmp_path):
    with tc.CheckpointManager(tmp_path, max_to_keep=None, incremental=True) as manager:
        w = jnp.arange(16, dtype=jnp.float32)
        manager.save(0, {"w": w})
        w.delete()
        w = jnp.zeros(16, jnp.float32)
        manager.save(1, {"w": w})
        np.testing.assert_array_equal(manager.restore(1)["w"], np.zeros(16, np.float32))
        np.testing.assert_array_equal(manager.restore(0)["w"], np.arange(16, dtype=np.float32))


def test_gc_removes_a_retired_step_once_no_checkpoint_references_it(tmp_path):
    base = {"w": np.arange(64, dtype=np.float32)}
    with tc.CheckpointManager(tmp_path, max_to_keep=1, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
    assert main(["gc", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["step_0", "step_1"]  # step_1 references the retired step_0
    shutil.rmtree(tmp_path / "step_1")  # deleted by hand: nothing references step_0 any more
    assert main(["gc", str(tmp_path)]) == 0
    assert os.listdir(tmp_path) == []
