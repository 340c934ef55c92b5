"""References between steps (an incremental save's ``../step_<n>/<file>``, FORMAT.md
"References"): readers accept them only to a sibling step of the run directory, with the
recorded size; hostile ones are refused with typed errors naming the file."""

import json
import os
import shutil

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.format._manifest import seal, unseal


@pytest.fixture
def run(tmp_path):
    """A run directory whose step_1 references step_0's data file for "base"."""
    base = {"w": np.arange(256, dtype=np.float32)}
    with tc.CheckpointManager(tmp_path / "run", max_to_keep=None, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
    return tmp_path / "run"


def edit_files(step_dir, edit) -> None:
    """Rewrites the manifest's ``files`` through ``edit`` and seals it again (a hostile edit)."""
    path = step_dir / "manifest.json"
    body, _ = unseal(path.read_bytes(), where=str(path))
    doc = json.loads(body)
    doc["files"] = [edit(name, size) for name, size in doc["files"]]
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))


def referenced_name(step_dir) -> str:
    body, _ = unseal((step_dir / "manifest.json").read_bytes(), where="m")
    return next(name for name, _ in json.loads(body)["files"] if name.startswith("../"))


def test_a_reference_restores_and_names_the_sibling(run):
    assert referenced_name(run / "step_1") == "../step_0/d00000-00000.safetensors"
    restored = tc.restore(str(run / "step_1"))
    np.testing.assert_array_equal(restored["base"]["w"], np.arange(256, dtype=np.float32))


@pytest.mark.parametrize(
    "hostile",
    ["../../elsewhere/d00000-00000.safetensors", "/etc/passwd", "../step_0/../../x.safetensors", "../", "../step_0/"],
)
def test_references_leading_out_of_the_run_directory_are_refused(run, hostile):
    edit_files(run / "step_1", lambda name, size: [hostile if name.startswith("../") else name, size])
    with pytest.raises(tc.CorruptCheckpointError) as raised:
        tc.restore(str(run / "step_1"))
    assert hostile in str(raised.value)


def test_a_reference_to_a_directory_that_is_no_step_is_refused(run, tmp_path):
    os.makedirs(run / "notastep")
    shutil.copy(run / "step_0" / "d00000-00000.safetensors", run / "notastep")
    for target in ("step_9", "notastep"):
        edit_files(
            run / "step_1",
            lambda name, size, t=target: [f"../{t}/d00000-00000.safetensors" if name.startswith("../") else name, size],
        )
        with pytest.raises(tc.CorruptCheckpointError, match=f"{target}/d00000-00000.safetensors"):
            tc.restore(str(run / "step_1"))


def test_a_referenced_file_of_another_size_is_refused(run):
    edit_files(run / "step_1", lambda name, size: [name, size + 64 if name.startswith("../") else size])
    with pytest.raises(tc.CorruptCheckpointError, match="step_0/d00000-00000.safetensors"):
        tc.restore(str(run / "step_1"))


def test_a_referenced_file_deleted_by_hand_fails_the_restore_naming_it(run):
    os.remove(run / "step_0" / "d00000-00000.safetensors")
    with pytest.raises(tc.CheckpointError, match="step_0/d00000-00000.safetensors"):
        tc.restore(str(run / "step_1"))
