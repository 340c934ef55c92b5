"""What a CheckpointManager lists is what it restores (issue #38): a damaged or stray newest
persistent step is named by restore(), skipped by restore(fallback=True) with a warning,
never named by latest_step()/all_steps(), and never makes retention remove the newest intact step."""

import logging
import os

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.manager.test_deleters_race import run_url  # noqa: F401 - the fixture: local, gs, s3
from tpu_ckpt import storage


def _tree(step: int) -> dict:
    return {"w": np.arange(32, dtype=np.float32).reshape(8, 4) + step, "step": step}


def _same(restored: dict, step: int) -> None:
    assert restored["step"] == step and np.array_equal(restored["w"], _tree(step)["w"]), restored


def _damage(path) -> None:
    """Flips one byte of a manifest's body: its seal (crc32c) no longer matches."""
    data = bytearray((path / "manifest.json").read_bytes())
    data[20] ^= 1
    (path / "manifest.json").write_bytes(bytes(data))


def _stray(run, step: int) -> None:
    """A step directory with a manifest that is no checkpoint of ours (put there by other means)."""
    os.makedirs(run / f"step_{step}")
    (run / f"step_{step}" / "manifest.json").write_text('{"not": "a tpu_ckpt manifest"}')


@pytest.mark.parametrize("spoil", ["damaged", "stray"])
def test_a_bad_newest_step_is_named_by_restore_and_skipped_only_with_fallback(tmp_path, caplog, spoil):
    run = tmp_path / "run"
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))
    bad = 3 if spoil == "damaged" else 9
    _damage(run / "step_3") if spoil == "damaged" else _stray(run, 9)
    good = 2 if spoil == "damaged" else 3
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        assert manager.latest_step() == good
        assert bad not in manager.all_steps() and good in manager.all_steps()
        with pytest.raises(tc.CorruptCheckpointError) as error:
            manager.restore(None, _tree(0))
        assert f"step of {run}, {bad}," in str(error.value) and "fallback=True" in str(error.value), error.value
        assert error.value.file.endswith(f"step_{bad}"), error.value.file
        with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
            _same(manager.restore(None, _tree(0), fallback=True), good)
        assert [r.getMessage() for r in caplog.records if f"skipping step {bad} " in r.getMessage()], caplog.text
        with pytest.raises(tc.CorruptCheckpointError):
            manager.restore(bad, _tree(0))  # asked for by number: refused, naming what is wrong
        _same(manager.restore(1, _tree(0)), 1)


def test_a_stray_newest_step_locally_and_on_object_stores_is_skipped_only_with_fallback(run_url, caplog):  # noqa: F811
    with tc.CheckpointManager(run_url, max_to_keep=None) as manager:
        for step in (1, 2):
            manager.save(step, _tree(step))
    if "://" not in run_url:
        os.makedirs(f"{run_url}/step_9")
    with storage.Store(storage.location(f"{run_url}/step_9")) as store:
        store.write("manifest.json", [b'{"format": "not ours"}']).result()
    with tc.CheckpointManager(run_url, max_to_keep=None) as manager:
        assert manager.latest_step() == 2 and manager.all_steps() == [1, 2]
        with pytest.raises(tc.CorruptCheckpointError, match=", 9, cannot be restored"):
            manager.restore(None, _tree(0))
        with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
            _same(manager.restore(None, _tree(0), fallback=True), 2)
        assert "skipping step 9 " in caplog.text


def test_every_step_damaged_is_not_found_naming_them(tmp_path):
    run = tmp_path / "run"
    with tc.CheckpointManager(run) as manager:
        manager.save(1, _tree(1))
    _damage(run / "step_1")
    with tc.CheckpointManager(run) as manager:
        assert manager.latest_step() is None and manager.all_steps() == []
        with pytest.raises(tc.CheckpointNotFoundError, match="step 1: CorruptCheckpointError"):
            manager.restore(None, _tree(0), fallback=True)


def test_retention_keeps_the_newest_intact_step_below_a_stray_one(tmp_path):
    # Retention orders steps as saved (the step just saved is the newest): a job rewound to step 1
    # lets every other step go with max_to_keep=1, but the newest intact one, 3, while 100 is stray.
    run = tmp_path / "run"
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        for step in (2, 3):
            manager.save(step, _tree(step))
    _stray(run, 100)
    with tc.CheckpointManager(run, max_to_keep=1) as manager:
        manager.save(1, _tree(1))
        assert sorted(os.listdir(run)) == ["step_1", "step_3"]
        assert manager.latest_step() == 3
        _same(manager.restore(None, _tree(0)), 3)


def test_a_multi_tier_manager_lists_and_restores_the_local_step_below_a_damaged_persistent_one(tmp_path, caplog):
    run, local = tmp_path / "run", tmp_path / "local"
    with tc.CheckpointManager(run, save_interval_steps=100, local_directory=local, max_to_keep=None) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))  # step 1 in both tiers, 2 and 3 local
    _stray(run, 9)
    with tc.CheckpointManager(run, save_interval_steps=100, local_directory=local, max_to_keep=None) as manager:
        assert manager.latest_step() == 3 and manager.all_steps() == [1]
        with pytest.raises(tc.CorruptCheckpointError, match="step_9|, 9,"):
            manager.restore(None, _tree(0))
        with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
            _same(manager.restore(None, _tree(0), fallback=True), 3)
        assert "skipping step 9 " in caplog.text
