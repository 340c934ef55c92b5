"""A save that loses its files, or cannot write them, commits nothing and says which file.

Two ways a save's files go wrong after it started:

- its staging area changes between the data writes and the commit (``tpu-ckpt gc`` at the
  wrong moment, another job cleaning the same directory). The hook that reaches exactly that
  moment is a sharding callback's ``description``: a save reads it to validate the shards
  (before any write: no staging area exists yet) and again to build the manifest, after
  every data file is written and before the commit. ``Sabotage`` acts on that second read.
- a write fails: a real full file system (a tmpfs in a private mount namespace: ENOSPC) or
  a real per-file size limit (``RLIMIT_FSIZE``: EFBIG), both in a worker process
  (full_disk_worker.py), sized so that either the data file or the manifest does not fit.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import tpu_ckpt as tc
from tpu_ckpt import storage

WORKER = os.path.join(os.path.dirname(__file__), "full_disk_worker.py")


class Sabotage(tc.ShardByDevicePolicy):
    """One file per device; ``act()`` at the first read of ``description`` once ``written()``."""

    def __init__(self, written: Callable[[], bool], act: Callable[[], None]):
        self._written, self._act, self.acted = written, act, False

    @property
    def description(self) -> str:
        if not self.acted and self._written():
            self.acted = True
            self._act()
        return super().description


def tree() -> dict:
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), PartitionSpec("x"))
    return {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), sharding), "step": 1}


def remove_third_file(staging: str) -> None:
    os.unlink(os.path.join(staging, "d00000-00002.safetensors"))


def truncate_third_file(staging: str) -> None:
    os.truncate(os.path.join(staging, "d00000-00002.safetensors"), 10)


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (shutil.rmtree, r"d00000-00000\.safetensors is missing \(and 7 more files\)"),
        (remove_third_file, r"d00000-00002\.safetensors is missing:"),
        (truncate_third_file, r"d00000-00002\.safetensors holds 10 bytes, not the \d+ written"),
    ],
    ids=["staging-removed", "file-removed", "file-truncated"],
)
def test_a_staging_area_changed_before_the_commit_is_not_committed(tmp_path, change, problem, enable_async):
    path, staged = tmp_path / "c", str(tmp_path / "c.tmp-*")
    sabotage = Sabotage(lambda: bool(glob.glob(staged + "/*.safetensors")), lambda: change(glob.glob(staged)[0]))
    options = tc.CheckpointOptions(sharding_callback=sabotage, enable_async=enable_async)
    with pytest.raises(tc.CheckpointError, match=problem) as e:
        tc.save(path, tree(), options=options).wait()
    assert sabotage.acted
    assert e.value.file.endswith(".safetensors") and "Nothing was committed" in str(e.value)
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging area, no recreated directory
    tc.save(path, tree()).wait()  # the path is free for the next save
    np.testing.assert_array_equal(tc.restore(path)["w"], np.arange(64, dtype=np.float32).reshape(8, 8))


def test_an_object_store_prefix_that_lost_a_data_file_is_not_committed():
    """On an object store the staging area is the final prefix, checked by one listing."""
    url = "memory://integrity/lost_file"
    store = storage.Store(storage.location(url))
    third = lambda: next(n for n in store.list() if n.endswith("d00000-00002.safetensors"))  # noqa: E731 (its name carries the save's token)
    sabotage = Sabotage(lambda: bool(store.list()), lambda: store.delete(third()))
    with pytest.raises(
        tc.CheckpointError, match=r"lost_file/[0-9a-f]{4}-[0-9a-f]+-d00000-00002\.safetensors is missing"
    ) as e:
        tc.save(url, tree(), options=tc.CheckpointOptions(sharding_callback=sabotage))
    store.close()
    assert sabotage.acted and e.value.file.startswith(f"{url}/") and e.value.file.endswith("-d00000-00002.safetensors")
    assert storage.is_empty(storage.location(url))


def _why_no_tmpfs(directory: str) -> str | None:
    """Why a tmpfs cannot be mounted in a private mount namespace here, or None if it can."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare(1) and mount(8) to mount a tiny tmpfs"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", directory],
        capture_output=True, text=True,
    )
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace (needs CAP_SYS_ADMIN): {probe.stderr.strip()}"
    return None


@pytest.mark.parametrize("mechanism", ["tmpfs", "fsize"])
def test_a_file_that_does_not_fit_fails_the_save_naming_it_and_leaves_nothing(tmp_path, mechanism):
    command = [sys.executable, WORKER, mechanism, str(tmp_path)]
    reason = "File too large"
    if mechanism == "tmpfs":
        why_not = _why_no_tmpfs(str(tmp_path))
        if why_not:
            pytest.skip(why_not)
        command = ["unshare", "-m", "--propagation", "private", *command]
        reason = "No space left on device"
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    results = {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert sorted(results) == ["data-async", "data-sync", "manifest-async", "manifest-sync"]
    for case, result in results.items():
        # the commit writes the piece tables, then the manifest: either may be the one that does not fit
        names = (
            ("/manifest.json", "/pieces-00000.bin") if case.startswith("manifest") else ("/d00000-00000.safetensors",)
        )
        assert result["types"] and "CheckpointError" in result["types"], result
        assert f"/{case}/c.tmp-" in result["file"] and result["file"].endswith(names), result
        assert result["file"] in result["message"], result
        assert reason in result["message"], result
        assert result["left"] == [], result  # the staging area was removed; nothing committed
