"""Cleaners never delete a save in flight (issue #28): ``tpu-ckpt gc`` and a
CheckpointManager's leftover cleanup, run while a save is between its data writes and its
commit, leave that save alone, on a local disk and on the GCS and S3 emulators; two
managers on one directory both commit. A save writes a staging marker first (FORMAT.md):
a leftover is removed only once its marker's grace period is over.

The moment between the writes and the commit is reached through a sharding callback's
``description``, which a save reads after every data file is written (test_save_integrity.py).
"""

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.saving.test_save_integrity import Sabotage, tree
from tests.support.object_stores import Bucket
from tpu_ckpt import catalog, cli, storage
from tpu_ckpt.format import STAGING_MARKER

PLACES = ["local", *(pytest.param(scheme, marks=pytest.mark.emulator) for scheme in ("gs", "s3"))]


@pytest.fixture(params=PLACES)
def run_url(request, tmp_path) -> str:
    """A run directory on a local disk, or in the GCS or the S3 emulator."""
    if request.param == "local":
        return str(tmp_path / "run")
    server = request.getfixturevalue({"gs": "gcs_server", "s3": "s3_server"}[request.param])
    return Bucket(server, f"race-{uuid.uuid4().hex[:8]}").url("run")


def data_written(url: str) -> Callable[[], bool]:
    """Whether a data file is stored anywhere under the run directory (staging areas included)."""

    def written() -> bool:
        with storage.Store(storage.location(url), threads=1) as store:
            return any(name.endswith(".safetensors") for name in store.list())

    return written


def assert_restores(url: str, steps: list[int]) -> None:
    with tc.CheckpointManager(url, max_to_keep=None) as manager:
        assert manager.all_steps() == steps
        for step in steps:
            np.testing.assert_array_equal(np.asarray(manager.restore(step)["w"]), np.asarray(tree()["w"]))


@pytest.mark.parametrize("enable_async", [False, True])
def test_gc_during_a_managers_save_removes_none_of_it(run_url, enable_async, capsys):
    gc_said = []
    sabotage = Sabotage(
        data_written(run_url), lambda: gc_said.append((cli.main(["gc", run_url]), capsys.readouterr().out))
    )
    options = tc.CheckpointOptions(sharding_callback=sabotage, enable_async=enable_async)
    with tc.CheckpointManager(run_url, max_to_keep=None, options=options) as manager:
        manager.save(1, tree())
        manager.wait_until_finished()  # raises if the save lost its files
    assert sabotage.acted and gc_said[0][0] == 0
    assert gc_said[0][1].startswith("kept step_1") and "may still be running" in gc_said[0][1]
    assert_restores(run_url, [1])


def test_gc_during_a_plain_save_removes_none_of_it(run_url, capsys):
    gc_said = []
    sabotage = Sabotage(data_written(run_url), lambda: gc_said.append(cli.main(["gc", run_url])))
    target = storage.location(run_url).child("model")
    tc.save(target, tree(), options=tc.CheckpointOptions(sharding_callback=sabotage, enable_async=True)).wait()
    assert sabotage.acted and gc_said == [0]
    np.testing.assert_array_equal(np.asarray(tc.restore(target)["w"]), np.asarray(tree()["w"]))


def test_two_managers_on_one_directory_lose_no_step(run_url):
    """Manager B saves (and cleans up) while manager A's save of another step is in flight."""
    other = tc.CheckpointManager(run_url, max_to_keep=None)
    sabotage = Sabotage(data_written(run_url), lambda: other.save(3, tree()))
    options = tc.CheckpointOptions(sharding_callback=sabotage)
    with tc.CheckpointManager(run_url, max_to_keep=None, options=options) as manager:
        manager.save(2, tree())
    other.close()
    assert sabotage.acted
    assert_restores(run_url, [2, 3])


def plant(url: str, name: str, started: float) -> None:
    """The staging area of a save that started at ``started`` and wrote one data file."""
    with storage.open_staging(storage.Location(storage.location(url).child(name))) as store:
        store.write("d00000-00000.safetensors", [b"partial"]).result()
        marker = {"final": name.partition(".tmp-")[0], "token": "0a1b", "started": started, "grace_s": 3600}
        store.write(STAGING_MARKER, [json.dumps(marker).encode()]).result()


def test_cleanups_remove_leftovers_once_their_grace_period_is_over(run_url, capsys):
    """Leftovers found when the manager first lists the run (on an object store it then keeps
    the listing; what others write later it sees after ``reload()``)."""
    plant(run_url, "step_4", 0.0)  # died long ago
    plant(run_url, "step_5", time.time())  # may be running
    plant(run_url, "mine", 0.0)  # a plain save that died long ago: marked, so ours
    with tc.CheckpointManager(run_url, max_to_keep=None) as manager:
        manager.save(1, tree())
        manager.save(2, tree())
        names = {e.name for e in catalog.scan(run_url)}
        assert names == {"step_1", "step_2", "step_5", "mine"}  # the manager removes its own leftovers only
        capsys.readouterr()
        assert cli.main(["gc", run_url]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("removed mine (uncommitted, 2 files")
        assert out[1].startswith("kept step_5 (a save that may still be running; removable in ")
        assert {e.name for e in catalog.scan(run_url)} == {"step_1", "step_2", "step_5"}
        assert manager.all_steps() == [1, 2]



JOB = r"""
import sys
import numpy as np
import tpu_ckpt as tc

url, first = sys.argv[1], int(sys.argv[2])
options = tc.CheckpointOptions(enable_async=True)
with tc.CheckpointManager(url, max_to_keep=None, options=options) as manager:
    for step in range(first, first + 12, 2):
        manager.save(step, {"w": np.full(4 << 20, step, np.float32)})  # 16 MB
print("SAVED")
"""


@pytest.mark.slow
def test_two_jobs_saving_async_into_one_directory_lose_no_step(run_url):
    """Two processes, each with its manager on the same directory, saving alternate steps
    asynchronously: every step either job was told is saved restores."""
    jobs = [subprocess.Popen([sys.executable, "-c", JOB, run_url, str(first)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for first in (0, 1)]
    outputs = [job.communicate(timeout=600) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [err[-3000:] for _, err in outputs]
    with tc.CheckpointManager(run_url, max_to_keep=None) as manager:
        assert manager.all_steps() == list(range(12))
        for step in range(12):
            w = np.asarray(manager.restore(step)["w"])
            assert w.shape == (4 << 20,) and (w == step).all(), step
