"""The local tier's upload reads its local files, checked, never mapped (#26).

An upload mapped each local data file and handed the mapping to the destination's writes: a
local file truncated meanwhile killed the process with SIGBUS, and a local file damaged
before its upload was copied as it was and committed (with ``max_to_keep=1`` the last good
persistent step went too). An upload now reads each file into memory (``safe_reads``) and
checks every piece's crc32c as it reads it: a damaged or truncated file fails the upload,
which commits nothing, while the local step stays.

The moments are reached through the upload itself: ``_copy`` (the step that reads the local
files) is wrapped to change a local file just before it runs, or, for the truncation during
the upload, its store to change it just before the first write.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.catalog import verify
from tpu_ckpt.tiers import _upload as uploads

DATA = "d00000-00000.safetensors"


def tree(step: int) -> dict:
    return {"w": np.arange(4096, dtype=np.float32) + step, "step": step}


def manager(tmp_path, **kwargs) -> tc.CheckpointManager:
    return tc.CheckpointManager(
        str(tmp_path / "persistent"), max_to_keep=1, local_directory=str(tmp_path / "local"), **kwargs
    )


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))


def truncate_to_half(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def before_the_upload_reads(monkeypatch, change) -> None:
    """``change(path)`` runs on the local data file of the next upload, just before it is read."""
    original = uploads._copy

    def copy(index, source, names, writes):
        change(os.path.join(source, DATA))
        return original(index, source, names, writes)

    monkeypatch.setattr(uploads, "_copy", copy)


@pytest.mark.parametrize(
    ("change", "problem"),
    [(flip_last_byte, r"crc32c"), (truncate_to_half, r"truncated")],
    ids=["damaged", "truncated"],
)
def test_a_bad_local_file_fails_its_upload_and_commits_nothing(tmp_path, monkeypatch, change, problem):
    with manager(tmp_path) as m:
        m.save(1, tree(1))
        m.wait_until_finished()
        before_the_upload_reads(monkeypatch, change)
        m.save(2, tree(2))
        with pytest.raises(tc.CorruptCheckpointError, match=problem) as caught:
            m.wait_until_finished()
        assert caught.value.file.endswith(os.path.join("step_2", DATA)), caught.value.file
        assert "step_2" in str(caught.value) and DATA in str(caught.value)
        assert "nothing was committed to the persistent tier" in str(caught.value)
        assert m.all_steps() == [1]  # not committed, and the last good persistent step kept
    assert sorted(os.listdir(tmp_path / "persistent")) == ["step_1"]  # nothing of the failed upload
    assert verify(str(tmp_path / "persistent" / "step_1")).ok
    np.testing.assert_array_equal(tc.restore(str(tmp_path / "persistent" / "step_1"))["w"], tree(1)["w"])
    assert "step_2" in os.listdir(tmp_path / "local")  # the local step stays


_TRUNCATED_DURING_THE_UPLOAD = r"""
import os, sys
import numpy as np
import tpu_ckpt as tc
from tpu_ckpt.tiers import _upload as uploads

root, destination = sys.argv[1], sys.argv[2]
original = uploads._copy

class TruncatingFirst:
    '''The upload's real store; its first write truncates the local file being uploaded.'''
    def __init__(self, store, path):
        self.store, self.path = store, path
    def write(self, name, buffers):
        if self.path is not None:
            os.truncate(self.path, 4096)
            self.path = None
        return self.store.write(name, buffers)
    def __getattr__(self, name):
        return getattr(self.store, name)

def copy(index, source, names, writes):
    writes.store = TruncatingFirst(writes.store, os.path.join(source, "d00000-00000.safetensors"))
    return original(index, source, names, writes)

uploads._copy = copy
w = np.arange(1 << 20, dtype=np.float32)
with tc.CheckpointManager(destination, local_directory=os.path.join(root, "local")) as m:
    m.save(1, {"w": w})
    try:
        m.wait_until_finished()
    except tc.CheckpointError as e:
        print("UPLOAD FAILED", type(e).__name__, e)
    if m.all_steps() == [1]:
        np.testing.assert_array_equal(m.restore(1)["w"], w)
        print("RESTORED")
"""


@pytest.mark.parametrize("destination", ["local", "memory"])
def test_a_local_file_truncated_during_its_upload_does_not_kill_the_process(tmp_path, destination):
    """The upload's bytes were read (and checked) before the truncation: it commits them."""
    target = str(tmp_path / "persistent") if destination == "local" else f"memory://uploads-{tmp_path.name}"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATED_DURING_THE_UPLOAD, str(tmp_path), target],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    assert "RESTORED" in done.stdout and "UPLOAD FAILED" not in done.stdout, done.stdout[-3000:]
