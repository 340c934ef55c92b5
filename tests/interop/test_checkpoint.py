"""The TF-style Checkpoint: save/write/restore/read/sync and save_counter."""

import os
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc


def test_save_numbers_paths_and_restore_loads_into_attributes(tmp_path, mesh42, mesh24):
    w = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh42, P("data")))
    ckpt = tc.Checkpoint(model={"w": w}, step=5)
    first = ckpt.save(tmp_path / "ckpt")
    assert first == f"{tmp_path}/ckpt-1" and ckpt.save_counter == 1
    ckpt.step = 6
    second = ckpt.save(tmp_path / "ckpt")
    assert second.endswith("ckpt-2") and ckpt.save_counter == 2
    # A fresh object whose attributes describe the targets (another mesh), counter included.
    other = jax.device_put(np.zeros((8, 4)), NamedSharding(mesh24, P(None, "model")))
    fresh = tc.Checkpoint(model={"w": other}, step=0)
    assert fresh.restore(first) is fresh
    np.testing.assert_array_equal(np.asarray(fresh.model["w"]), np.arange(32.0).reshape(8, 4))
    assert fresh.model["w"].sharding == other.sharding
    assert fresh.step == 5 and fresh.save_counter == 1
    fresh.read(second)
    assert fresh.step == 6 and fresh.save_counter == 1  # read leaves the counter alone


def test_write_uses_the_exact_path_and_keeps_the_counter(tmp_path):
    ckpt = tc.Checkpoint(a=np.ones(3))
    assert ckpt.write(tmp_path / "exact") == str(tmp_path / "exact")
    assert ckpt.save_counter == 0 and os.path.exists(tmp_path / "exact" / "manifest.json")


def test_attributes_assigned_later_are_saved(tmp_path):
    ckpt = tc.Checkpoint(a=np.ones(2))
    ckpt.late = {"x": np.arange(3)}
    path = ckpt.save(tmp_path / "c", options=tc.CheckpointOptions(enable_async=True))
    ckpt.sync()
    assert tc.metadata(path)["late"]["x"].shape == (3,)


def test_sync_waits_and_reraises(tmp_path):
    gate = threading.Event()
    ckpt = tc.Checkpoint(a=np.ones(2))
    ckpt.save(tmp_path / "c", options=tc.CheckpointOptions(enable_async=True, write_callbacks=[lambda: gate.wait()]))
    assert not os.path.exists(tmp_path / "c-1")
    gate.set()
    ckpt.sync()
    assert os.path.exists(tmp_path / "c-1" / "manifest.json")

    def boom():
        raise RuntimeError("callback failed")

    ckpt.save(tmp_path / "c", options=tc.CheckpointOptions(enable_async=True, write_callbacks=[boom]))
    with pytest.raises(RuntimeError, match="callback failed"):
        ckpt.sync()


def test_a_failed_sync_save_does_not_consume_a_number(tmp_path):
    ckpt = tc.Checkpoint(a=np.ones(2))
    ckpt.save(tmp_path / "c")
    os.rename(tmp_path / "c-1", tmp_path / "keep")
    (tmp_path / "c-2").mkdir()
    (tmp_path / "c-2" / "junk").write_text("x")
    with pytest.raises(tc.CheckpointExistsError):
        ckpt.save(tmp_path / "c")
    assert ckpt.save_counter == 1


def test_restore_reports_missing_attributes_by_key(tmp_path):
    tc.Checkpoint(a=np.ones(2)).write(tmp_path / "c")
    with pytest.raises(tc.TargetMismatchError, match="'b'"):
        tc.Checkpoint(a=np.ones(2), b=np.ones(1)).read(tmp_path / "c")


def test_reserved_and_unknown_names():
    with pytest.raises(ValueError, match="save_counter"):
        tc.Checkpoint(save_counter=3)
    ckpt = tc.Checkpoint(a=1)
    with pytest.raises(AttributeError, match="no tree named 'b'"):
        ckpt.b  # noqa: B018
    with pytest.raises(ValueError, match="non-negative int"):
        ckpt.save_counter = -1
