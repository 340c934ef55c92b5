"""Hostile files of the local tier (tier.json, plan.json, index files): the same safe-read
and decode rules as a manifest's, so a local step that is damaged or built to do harm is
skipped or refused with a typed error, never a hang or a raw exception (issue #26)."""

import json
import os
import shutil

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import sealed

TREE = {"w": np.full((8, 4), 3, np.float32), "step": 3}


def _manager(tmp_path) -> tc.CheckpointManager:
    return tc.CheckpointManager(
        str(tmp_path / "persistent"), save_interval_steps=100, local_directory=str(tmp_path / "local"),
        local_interval_steps=1,
    )


@pytest.fixture
def step(tmp_path):
    """A local step 3 (nothing persistent), and its directory."""
    with _manager(tmp_path) as m:
        m.save(3, TREE)  # a first save goes to both tiers: the persistent copy is dropped
    shutil.rmtree(tmp_path / "persistent" / "step_3")
    return tmp_path / "local" / "step_3"


def _replace(path, how: str) -> None:
    os.unlink(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        os.symlink(how, path)


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("how", ["fifo", "/dev/zero", "/dev/urandom", "deep"])
def test_a_hostile_tier_file_skips_the_step(tmp_path, step, how, caplog):
    _replace(step / "tier.json", how)
    with _manager(tmp_path) as m:
        assert m.latest_step() is None
        with pytest.raises(tc.CheckpointNotFoundError):
            m.restore()
    assert "ignoring the local step" in caplog.text and "tier.json" in caplog.text


def _edit(path, change) -> None:
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_bytes(sealed(doc))


def _w(doc) -> dict:
    return next(leaf for leaf in doc["leaves"] if leaf["key"] == "w")


@pytest.mark.parametrize("file, change", [
    ("plan.json", lambda d: _w(d).update(dtype="int8")),
    ("plan.json", lambda d: _w(d).update(dtype="float64")),
])
def test_a_resealed_local_plan_or_index_that_disagrees_is_refused(tmp_path, step, file, change):
    _edit(step / file, change)
    with _manager(tmp_path) as m:
        with pytest.raises(tc.CorruptCheckpointError) as e:
            m.restore()
    assert "step_3" in str(e.value)


@pytest.mark.parametrize("file", ["plan.json", "index-00000.bin", "d00000-00000.safetensors"])
def test_a_local_file_linked_outside_is_refused(tmp_path, step, file):
    outside = tmp_path / "outside"
    outside.write_bytes((step / file).read_bytes())
    _replace(step / file, str(outside))
    with _manager(tmp_path) as m:
        with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
            m.restore()
