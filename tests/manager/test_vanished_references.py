"""An incremental save whose references vanished writes those pieces itself (issue #38,
item 2): the step it would reference was deleted by hand, or is damaged. No reload() needed;
the "staging area changed" error is kept for a staging area that changed."""

import logging
import os
import shutil

import pytest

import tpu_ckpt as tc
from tests.manager.retention_kill_worker import tree
from tests.manager.test_deleters_race import run_url  # noqa: F401 - the fixture: local, gs, s3
from tests.manager.test_retention_references import assert_listed_steps_restore
from tpu_ckpt import storage


def remove_step_1(url: str) -> None:
    with storage.Store(storage.location(storage.location(url).child("step_1")), threads=1) as store:
        store.delete_all()


def test_a_save_after_its_referenced_step_was_deleted_writes_the_pieces_itself(run_url, caplog):  # noqa: F811
    with tc.CheckpointManager(run_url, max_to_keep=None, incremental=True) as manager:
        manager.save(1, tree(1))
        manager.save(2, tree(2))  # references step 1's "a" and "b"
        remove_step_1(run_url)
        with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
            try:
                manager.save(3, tree(3))
            except tc.CheckpointError as error:  # an object store's listing, kept since, still names step_1
                assert not storage.location(run_url).is_local
                assert "references data of step_1" in str(error) and "staging area" not in str(error), error
                manager.save(3, tree(3))
            else:
                assert "step_1 is gone" in caplog.text
        manager.save(4, tree(4))
        assert manager.all_steps()[-2:] == [3, 4]  # an object store still lists step_1 until reload()
    for step in (3, 4):
        restored = tc.restore(storage.location(run_url).child(f"step_{step}"))
        assert restored["a"].tobytes() == tree(step)["a"].tobytes() and int(restored["t"][0]) == step


def test_a_damaged_referenced_step_fails_one_save_naming_it_then_the_next_writes_all(tmp_path):
    with tc.CheckpointManager(tmp_path, max_to_keep=None, incremental=True) as manager:
        manager.save(1, tree(1))
        manager.save(2, tree(2))
        os.unlink(tmp_path / "step_1" / "d00000-00000.safetensors")  # step 1 still listed, its data gone
        with pytest.raises(tc.CheckpointError, match="references data of step_1") as raised:
            manager.save(3, tree(3))
        assert "staging area" not in str(raised.value) and "next save" in str(raised.value)
        manager.save(3, tree(3))
        manager.save(4, tree(4))
    shutil.rmtree(tmp_path / "step_1")
    shutil.rmtree(tmp_path / "step_2")
    assert assert_listed_steps_restore(str(tmp_path)) == [3, 4]
