"""Every kind of file tpu_ckpt reads, replaced by a link out of its checkpoint, a FIFO,
``/dev/zero`` or a truncated copy: each is a typed error within seconds, never a hang, a
raw exception or bytes from outside (issue #26). A hang fails the per-test timeout."""

import os
import shutil

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import manifest
from tpu_ckpt.catalog import verify

TREE = {"w": np.arange(512, dtype=np.float32).reshape(16, 32), "step": 3}
HAZARDS = ["link out", "fifo", "/dev/zero", "truncated"]


def _spoil(path, hazard: str) -> None:
    """``path`` replaced by ``hazard``; a link out points at an intact copy (its crc32c matches)."""
    if hazard == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
        return
    outside = path.parent.parent / f"outside-{path.name}"
    shutil.copyfile(path, outside)
    os.unlink(path)
    if hazard == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(outside if hazard == "link out" else hazard, path)


@pytest.fixture
def ckpt(tmp_path):
    tc.save(tmp_path / "c", TREE)
    return tmp_path / "c"


def _committed_file(ckpt, kind: str) -> str:
    doc = manifest(ckpt)
    return {"manifest": "manifest.json", "data file": doc["files"][0][0], "piece table": doc["tables"][0][0]}[kind]


@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize("hazard", HAZARDS)
@pytest.mark.parametrize("kind", ["manifest", "data file", "piece table"])
def test_a_spoiled_checkpoint_file_is_a_typed_error(ckpt, kind, hazard):
    _spoil(ckpt / _committed_file(ckpt, kind), hazard)
    with pytest.raises(tc.CorruptCheckpointError):
        tc.restore(ckpt)
    assert not verify(ckpt).ok


@pytest.fixture
def local_step(tmp_path):
    """A local step 3, and no persistent copy of it."""
    with _manager(tmp_path) as m:
        m.save(3, TREE)
    shutil.rmtree(tmp_path / "persistent" / "step_3")
    return tmp_path / "local" / "step_3"


def _manager(tmp_path) -> tc.CheckpointManager:
    return tc.CheckpointManager(
        str(tmp_path / "persistent"), save_interval_steps=100, local_directory=str(tmp_path / "local"),
        local_interval_steps=1,
    )


@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize("hazard", HAZARDS)
@pytest.mark.parametrize("name", ["tier.json", "plan.json", "index-00000.bin", "d00000-00000.safetensors"])
def test_a_spoiled_local_tier_file_is_a_typed_error(tmp_path, local_step, name, hazard):
    """A bad tier.json makes the step unknown (nothing else to restore); the others refuse it."""
    _spoil(local_step / name, hazard)
    with _manager(tmp_path) as m:
        with pytest.raises(tc.CheckpointNotFoundError if name == "tier.json" else tc.CorruptCheckpointError):
            m.restore()
