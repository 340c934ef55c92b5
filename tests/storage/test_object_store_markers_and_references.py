"""Review of per-save staging markers and lazy reference checks on object stores (round 3d):
against gcp-storage-emulator and moto."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import catalog
from tpu_ckpt.cli import main
from tpu_ckpt.format import STAGING_MARKER, spread
from tpu_ckpt.storage._stores import STAGING_GRACE_S

pytestmark = pytest.mark.emulator


def incremental_run(bucket) -> np.ndarray:
    """A run whose step_1 references step_0's data file for "base"; the base's values."""
    base = {"w": np.arange(1 << 16, dtype=np.float32)}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
    return base["w"]


@pytest.mark.timeout(120)
def test_a_reference_read_by_a_store_of_one_io_thread_is_checked_without_a_hang(bucket, knobs):
    """The check before a reference's first read runs on the IO thread of that read; its own
    requests must not wait for a thread of the same pool, which may be the only one."""
    base = incremental_run(bucket)
    knobs(io_threads=1, object_reads_in_flight=1)
    np.testing.assert_array_equal(tc.restore(bucket.url("run/step_1"))["base"]["w"], base)


RUNNING, HOSTILE = "77aa0199", "4"  # a save writing now; the token of a hand-made marker named before its


def put_marker(bucket, path: str, name: str, text: str) -> None:
    bucket.put(f"{path}/{name}", text.encode())


def running_save(bucket, path: str) -> set[str]:
    """The objects of a save of ``path`` that started a moment ago and is still writing."""
    marker = {"final": path.rsplit("/", 1)[-1], "token": RUNNING, "started": time.time(), "grace_s": STAGING_GRACE_S}
    names = {spread(RUNNING, "d00000-00000.safetensors"), spread(RUNNING, STAGING_MARKER)}
    bucket.put(f"{path}/{spread(RUNNING, 'd00000-00000.safetensors')}", b"half a save")
    put_marker(bucket, path, spread(RUNNING, STAGING_MARKER), json.dumps(marker))
    return names


HUGE = "1" + "0" * 400  # a JSON integer no float holds


@pytest.mark.parametrize(
    "hostile",
    [f'{{"final":"step_5","started":{HUGE},"grace_s":1}}', '{"final":"step_5","started":NaN,"grace_s":1}',
     '{"final":"step_5","started":1,"grace_s":NaN}', '{"final":"step_5","started":Infinity,"grace_s":-Infinity}',
     "[" * 60000],
)
def test_a_hostile_marker_neither_crashes_a_listing_nor_lets_gc_remove_a_running_save(bucket, capsys, hostile):
    """A marker whose numbers are no time (too large for a float, NaN) is an unreadable one:
    it holds nothing back, and it does not hide the grace period of the running save's marker."""
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, {"w": np.arange(8, dtype=np.float32)})
    running = running_save(bucket, "run/step_5")
    assert spread(HOSTILE, STAGING_MARKER) < spread(RUNNING, STAGING_MARKER)  # read first
    put_marker(bucket, "run/step_5", spread(HOSTILE, STAGING_MARKER), hostile)
    put_marker(bucket, "run/step_1", spread(HOSTILE, STAGING_MARKER), hostile)

    entries = {e.name: e for e in catalog.scan(bucket.url("run"))}
    assert catalog.busy(entries["step_5"]) and entries["step_1"].step == 1
    assert main(["gc", bucket.url("run")]) == 0
    assert running <= {key.rsplit("/", 1)[-1] for key in bucket.keys("run/step_5/")}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        assert manager.all_steps() == [1]
        manager.save(2, {"w": np.ones(8, np.float32)})
    assert running <= {key.rsplit("/", 1)[-1] for key in bucket.keys("run/step_5/")}
    np.testing.assert_array_equal(tc.restore(bucket.url("run/step_1"))["w"], np.arange(8, dtype=np.float32))


def test_a_plain_marker_naming_another_checkpoint_leaves_an_object_store_checkpoint_committed(bucket):
    """On an object store a manifest is the commit (a save writes into its final prefix): a
    plain ``staging.json`` naming another checkpoint (an older version's, copied with the
    checkpoint to a new name) makes it no staging area that ``gc`` may remove."""
    tc.save(bucket.url("run/best"), {"w": np.arange(8, dtype=np.float32)})
    marker = {
        "final": "step_5", "token": "5c0e9b21", "started": time.time() - 2 * STAGING_GRACE_S, "grace_s": STAGING_GRACE_S
    }
    put_marker(bucket, "run/best", STAGING_MARKER, json.dumps(marker))
    assert catalog.checkpoints_in(bucket.url("run")) == {"best": None}
    assert main(["gc", bucket.url("run")]) == 0
    assert "manifest.json" in {key.rsplit("/", 1)[-1] for key in bucket.keys("run/best/")}
    np.testing.assert_array_equal(tc.restore(bucket.url("run/best"))["w"], np.arange(8, dtype=np.float32))


def test_check_restore_refuses_a_missing_referenced_object_it_would_read_as_the_restore_does(bucket):
    """tc.check_restore reads no data, but an object store checks a reference only before it
    is first read: the check runs those of the references the restore would read, and
    fails as the restore (and a local check_restore) does, naming the object."""
    incremental_run(bucket)
    [reference] = [key for key in bucket.keys("run/step_0/") if key.endswith(".safetensors")]
    bucket.delete(reference)
    gone = reference.removeprefix("run/")
    target = {"base": {"w": np.zeros(1 << 16, np.float32)}, "t": np.zeros(4, np.float32)}
    with pytest.raises(tc.CorruptCheckpointError, match=f"{gone}.*missing"):
        tc.restore(bucket.url("run/step_1"))
    with pytest.raises(tc.CorruptCheckpointError, match=f"{gone}.*missing"):
        tc.check_restore(bucket.url("run/step_1"), target)
    assert tc.check_restore(bucket.url("run/step_1"), target["t"], subtree="t").ok  # reads nothing of step_0


def test_a_manager_saving_a_step_leaves_the_objects_of_a_save_of_it_still_running(bucket):
    """On an object store two saves of one step write side by side (their names carry their
    tokens): a manager saving step 5 beside a save of it still within its grace period (a
    zombie of an earlier incarnation) leaves that save's objects, which gc removes once its
    marker's grace period is over, and commits its own step 5."""
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, {"w": np.zeros(8, np.float32)})
    running = running_save(bucket, "run/step_5")
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(5, {"w": np.arange(8, dtype=np.float32)})
        assert manager.all_steps() == [1, 5]
    assert running <= {key.rsplit("/", 1)[-1] for key in bucket.keys("run/step_5/")}
    np.testing.assert_array_equal(tc.restore(bucket.url("run/step_5"))["w"], np.arange(8, dtype=np.float32))
    [strays] = catalog.strays(bucket.url("run"))
    assert strays.tokens == [RUNNING] and set(strays.files) == running and strays.held_until > time.time()


def test_a_leftover_committed_since_it_was_listed_stays_whatever_its_plain_marker_names(bucket):
    """A cleanup that listed ``best`` before its save committed finds its manifest just before
    deleting it: on an object store that is the commit, whatever checkpoint an expired plain
    marker beside it names."""
    marker = {
        "final": "step_5", "token": "5c0e9b21", "started": time.time() - 2 * STAGING_GRACE_S, "grace_s": STAGING_GRACE_S
    }
    put_marker(bucket, "run/best", STAGING_MARKER, json.dumps(marker))
    assert [e.name for e in catalog.scan(bucket.url("run"))] == ["best"]  # a leftover, as listed
    tc.save(bucket.url("run/best"), {"w": np.arange(8, dtype=np.float32)})  # committed since
    assert catalog.remove_leftovers(bucket.url("run"), ["best"]) == []
    np.testing.assert_array_equal(tc.restore(bucket.url("run/best"))["w"], np.arange(8, dtype=np.float32))


@pytest.mark.timeout(120)
def test_concurrent_first_reads_of_one_reference_share_one_check_and_its_error(bucket):
    """Many reads of one referenced object at once, more than the store has IO threads, all
    wait for one check: its error is each read's, and a later read's too."""
    incremental_run(bucket)
    with catalog.open_checkpoint(bucket.url("run/step_1"), threads=2) as checkpoint:
        [reference] = [name for name in checkpoint.manifest.files if name.startswith("../")]
        reads = [checkpoint.store.read(reference, 4 * i, [4]) for i in range(64)]
        stored = bucket.get(reference.replace("..", "run", 1))
        assert [bytes(r.result()[0]) for r in reads] == [stored[4 * i : 4 * i + 4] for i in range(64)]
    bucket.delete(reference.replace("..", "run", 1))
    with catalog.open_checkpoint(bucket.url("run/step_1"), threads=2) as checkpoint:
        reads = [checkpoint.store.read(reference, 4 * i, [4]) for i in range(64)]
        for read in [*reads, checkpoint.store.read(reference, 0, [4])]:
            with pytest.raises(tc.CorruptCheckpointError, match=f"{reference[3:]}.*missing"):
                read.result()
