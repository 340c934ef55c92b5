"""Restoring an incremental step whose referenced sibling step was deleted says so, naming
the step and the file it needed (issue #39), on a local disk and on an object store: before,
a local restore said the manifest "has been edited or damaged", which it had not."""

import shutil

import numpy as np
import pytest

import tpu_ckpt as tc

BASE = np.arange(4096, dtype=np.float32)


def two_steps(url: str) -> None:
    with tc.CheckpointManager(url, max_to_keep=None, incremental=True) as manager:
        for step in (1, 2):
            manager.save(step, {"base": BASE, "t": np.full(4, step, np.float32)})


def test_a_local_step_whose_referenced_step_was_deleted_says_so(tmp_path):
    two_steps(str(tmp_path / "run"))
    shutil.rmtree(tmp_path / "run" / "step_1")
    with pytest.raises(tc.CorruptCheckpointError, match="incremental step whose data file '../step_1/") as raised:
        tc.restore(tmp_path / "run" / "step_2")
    assert f"held by step {tmp_path / 'run' / 'step_1'}, which was deleted" in str(raised.value)
    assert "edited or damaged" not in str(raised.value)
    assert raised.value.file.startswith(str(tmp_path / "run" / "step_1") + "/")


@pytest.mark.emulator
def test_an_object_store_step_whose_referenced_step_was_deleted_says_so(bucket):
    two_steps(bucket.url("run"))
    for key in bucket.keys("run/step_1/"):
        bucket.delete(key)
    with pytest.raises(tc.CorruptCheckpointError) as raised:
        tc.restore(bucket.url("run/step_2"))
    assert "references data file ../step_1/" in str(raised.value)
    assert "which lies in no step of the run" in str(raised.value)
    assert "edited or damaged" not in str(raised.value)
