"""Whether something is a leftover is decided by what it holds, not by its name (issue #29):
a user's committed checkpoint named like a staging directory (``model.tmp-1``) is a
checkpoint, which ``tpu-ckpt gc`` and a CheckpointManager's cleanup never remove, on a
local disk and on the GCS and S3 emulators."""

import json
import os

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import cli, storage
from tpu_ckpt.format import STAGING_MARKER

TREE = {"w": np.arange(6, dtype=np.float32), "step": 7}
NAMES = ("model.tmp-1", "step_3.tmp-1")  # staging-like names, each a committed checkpoint


def names_in(loc: storage.Location) -> set[str]:
    with storage.Store(loc, threads=1) as store:
        return {name.partition("/")[0] for name in store.list()}


def check_committed_checkpoints_survive(url: str, capsys) -> None:
    loc = storage.location(url)
    for name in NAMES:
        tc.save(loc.child(name), TREE)
    with tc.CheckpointManager(url, max_to_keep=1) as manager:  # its cleanup runs after each save
        manager.save(1, TREE)
        manager.save(2, TREE)
        assert manager.all_steps() == [2]
    capsys.readouterr()
    assert cli.main(["gc", "--dry-run", url]) == 0
    assert capsys.readouterr().out == f"no leftovers in {url}\n"
    assert cli.main(["gc", url]) == 0
    assert cli.main(["ls", url]) == 0
    table = {row.split()[1]: row.split()[2] for row in capsys.readouterr().out.splitlines()[2:]}
    assert table == {**dict.fromkeys(NAMES, "committed"), "step_2": "committed"}
    assert names_in(loc) == {*NAMES, "step_2"}
    for name in NAMES:
        restored = tc.restore(loc.child(name))
        np.testing.assert_array_equal(restored["w"], TREE["w"])


def test_a_checkpoint_named_like_staging_is_never_removed_locally(tmp_path, capsys):
    check_committed_checkpoints_survive(str(tmp_path / "run"), capsys)
    assert sorted(os.listdir(tmp_path / "run")) == sorted([*NAMES, "step_2"])
    assert not any(os.path.exists(tmp_path / "run" / name / STAGING_MARKER) for name in [*NAMES, "step_2"])


def test_a_local_save_that_died_before_its_rename_is_a_leftover_whatever_it_holds(tmp_path, capsys):
    """Its manifest made it to disk, but its staging marker names another checkpoint."""
    run = tmp_path / "run"
    tc.save(run / "model", TREE)
    os.rename(run / "model", run / "model.tmp-0a1b")  # as it was just before the rename
    marker = {"final": "model", "token": "0a1b", "started": 0.0, "grace_s": 3600.0}  # long ago
    (run / "model.tmp-0a1b" / STAGING_MARKER).write_text(json.dumps(marker))
    tc.save(run / "kept.tmp-0a1b", TREE)
    (run / "kept.tmp-0a1b" / STAGING_MARKER).write_text("damaged")  # names no other checkpoint
    assert cli.main(["gc", str(run)]) == 0
    assert capsys.readouterr().out.startswith("removed model.tmp-0a1b (uncommitted, 4 files")
    assert sorted(os.listdir(run)) == ["kept.tmp-0a1b"]


@pytest.mark.emulator
def test_a_checkpoint_named_like_staging_is_never_removed_on_object_stores(bucket, capsys):
    check_committed_checkpoints_survive(bucket.url("run"), capsys)
    assert all(f"run/{name}/manifest.json" in bucket.keys() for name in NAMES)
