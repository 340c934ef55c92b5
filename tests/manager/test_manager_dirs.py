"""A CheckpointManager's directory handed to the API that takes one checkpoint.

It holds committed steps, so it is neither "no checkpoint" nor an interrupted save: every
entry point (restore, metadata, export, the export script) says it is a directory of
checkpoints, names them, and shows the call that restores one.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import tpu_ckpt as tc

EXPORT = [sys.executable, "-m", "tpu_ckpt", "export"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """run1/ckpts: steps 100, 200 and 300 committed, and the leftover of an interrupted save."""
    directory = tmp_path_factory.mktemp("manager") / "run1" / "ckpts"
    with tc.CheckpointManager(directory, max_to_keep=None) as manager:
        for step in (100, 200, 300):
            manager.save(step, {"params": {"w": np.full((4, 2), step, np.float32)}, "step": step})
    os.makedirs(directory / "step_400.tmp-0a1b2c")
    (directory / "step_400.tmp-0a1b2c" / "d00000-00000.safetensors").write_bytes(b"partial")
    return directory


def expected_message(directory) -> str:
    return (
        f"{directory} is a directory of checkpoints, not a checkpoint: it holds step_100, step_200, step_300. "
        f'Name one of them, e.g. tc.restore("{directory}/step_300") or '
        f'tc.CheckpointManager("{directory}").restore(300).'
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda d, tmp: tc.restore(d),
        lambda d, tmp: tc.restore(d, {"w": np.zeros((4, 2), np.float32)}, subtree="params"),
        lambda d, tmp: tc.metadata(d),
        lambda d, tmp: tc.export_for_serving(d, tmp / "serving"),
        lambda d, tmp: tc.export_for_serving(d, d.parent / "serving", link=True),
    ],
    ids=["restore", "restore-subtree", "metadata", "export", "export-link"],
)
def test_a_manager_directory_is_named_as_such_not_as_an_interrupted_save(ckpts, tmp_path, call):
    with pytest.raises(tc.CheckpointNotFoundError) as raised:
        call(ckpts, tmp_path)
    assert type(raised.value) is tc.CheckpointNotFoundError  # not UncommittedCheckpointError
    assert str(raised.value) == expected_message(ckpts)
    assert raised.value.file == str(ckpts)
    assert not os.path.exists(tmp_path / "serving") and not os.path.exists(ckpts.parent / "serving")


def test_the_export_script_says_the_same_and_the_calls_shown_work(ckpts, tmp_path):
    result = subprocess.run(
        [*EXPORT, ckpts, tmp_path / "serving"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == f"tpu-ckpt: error: {expected_message(ckpts)}"
    assert tc.restore(f"{ckpts}/step_300")["step"] == 300
    assert tc.CheckpointManager(ckpts).restore(300)["step"] == 300


def test_a_long_run_is_shortened_and_a_directory_without_steps_names_a_checkpoint(tmp_path):
    with tc.CheckpointManager(tmp_path / "long", max_to_keep=None) as manager:
        for step in range(1, 11):
            manager.save(step, {"step": step})
    with pytest.raises(tc.CheckpointNotFoundError, match=r"it holds step_1, step_2, step_3, \.\.\., step_9, step_10 "
                       r"\(10 checkpoints\)\. .*tc\.CheckpointManager\(.*\)\.restore\(10\)\.$"):
        tc.metadata(tmp_path / "long")
    tc.save(tmp_path / "exports" / "serving", {"w": np.zeros(2, np.float32)}).wait()
    with pytest.raises(tc.CheckpointNotFoundError) as raised:
        tc.restore(tmp_path / "exports")
    assert str(raised.value) == (
        f"{tmp_path / 'exports'} is a directory of checkpoints, not a checkpoint: it holds serving. "
        f'Name one of them, e.g. tc.restore("{tmp_path / "exports" / "serving"}").'
    )
    # A save that was interrupted, and a path holding nothing, are told as before.
    os.makedirs(tmp_path / "step_5")
    (tmp_path / "step_5" / "d00000-00000.safetensors").write_bytes(b"partial")
    with pytest.raises(tc.UncommittedCheckpointError, match="its save was interrupted"):
        tc.restore(tmp_path / "step_5")
    with pytest.raises(tc.CheckpointNotFoundError, match="^No checkpoint at"):
        tc.metadata(tmp_path / "nothing")
