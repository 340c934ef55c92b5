"""restore(fallback=True) when a step's *data* fails its checks as it is read (a piece's crc32c,
a truncated or missing data file), not only its manifest: every process alike restores the
newest intact step below it, with a warning naming the skipped one; without fallback, or for
a step asked for by number, the failure is raised. ``one_process_damaged`` is the scenario of
the 2-process test: only one process reads the damaged piece."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support import process_group


def _tree(step: int) -> dict:
    return {"w": np.arange(1024, dtype=np.float32) + step, "step": step}


def _data_files(step_dir: str, writer: int = 0) -> list[str]:
    return sorted(os.path.join(step_dir, name) for name in os.listdir(step_dir) if f"d{writer:05d}-" in name)


def _spoil(path: str, how: str) -> None:
    if how == "bit":
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)  # a byte of the last piece's data
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x10]))
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) - 100)
    else:
        os.remove(path)


@pytest.mark.parametrize("how", ["bit", "truncated", "missing"])
def test_a_step_whose_data_fails_is_skipped_only_with_fallback(tmp_path, caplog, how):
    run = tmp_path / "run"
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))
    _spoil(_data_files(str(run / "step_3"))[0], how)
    _spoil(_data_files(str(run / "step_2"))[0], "bit")
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        with pytest.raises(tc.CorruptCheckpointError, match="step_3"):
            manager.restore(None, _tree(0))
        with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
            restored = manager.restore(None, _tree(0), fallback=True)
        assert restored["step"] == 1 and np.array_equal(restored["w"], _tree(1)["w"]), restored
        skips = [r.getMessage() for r in caplog.records if "skipping step" in r.getMessage()]
        assert len(skips) == 2 and "step 3" in skips[0] and "step 2" in skips[1], skips
        assert all("restoring step 1" in s for s in skips), skips
        with pytest.raises(tc.CorruptCheckpointError, match="step_3"):
            manager.restore(3, _tree(0), fallback=True)  # asked for by number: refused as it is


def test_when_no_step_restores_the_error_names_every_one(tmp_path):
    run = tmp_path / "run"
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        for step in (1, 2):
            manager.save(step, _tree(step))
    for step in (1, 2):
        _spoil(_data_files(str(run / f"step_{step}"))[0], "bit")
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        with pytest.raises(tc.CorruptCheckpointError, match="No step of .* restores: step 2: .*; step 1: ") as error:
            manager.restore(None, _tree(0), fallback=True)
    assert "crc32c" in str(error.value), error.value


def test_a_target_mismatch_is_raised_not_skipped(tmp_path):
    run = tmp_path / "run"
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        for step in (1, 2):
            manager.save(step, _tree(step))
        with pytest.raises(tc.TargetMismatchError):
            manager.restore(None, {"w": np.zeros(5, np.float32), "step": 0}, fallback=True)


def one_process_damaged(directory: str) -> dict:
    """Steps 1 and 2 of a leaf sharded over both processes; process 1's piece of step 2 then
    fails its crc32c. Each process reads only its own piece, so only process 1 finds it."""
    from jax.experimental import multihost_utils

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    values = {step: np.arange(64, dtype=np.float32) + step for step in (1, 2)}
    run = os.path.join(directory, "run")
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        for step, value in values.items():
            manager.save(step, {"w": jax.make_array_from_callback((64,), sharding, lambda i, v=value: v[i])})
    multihost_utils.sync_global_devices("saved")
    if jax.process_index() == 1:
        _spoil(_data_files(os.path.join(run, "step_2"), writer=1)[0], "bit")
    multihost_utils.sync_global_devices("damaged")
    target = {"w": jax.ShapeDtypeStruct((64,), np.float32, sharding=sharding)}
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        restored = manager.restore(None, target, fallback=True)
    shards = {int(s.index[0].start or 0): np.asarray(s.data).tolist() for s in restored["w"].addressable_shards}
    return {"shards": shards, "expected": {k: values[1][k : k + 32].tolist() for k in (0, 32)}}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_step_damaged_on_one_process_is_skipped_by_every_process(tmp_path):
    for result in process_group.results_of(
        process_group.run("manager.test_data_fallback.one_process_damaged", 2, str(tmp_path), devices_per_process=1)
    ):
        (start, shard), = result["shards"].items()
        assert shard == result["expected"][start], (start, shard)  # step 1 on both: process 0 did not keep step 2
