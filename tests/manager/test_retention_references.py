"""Retention never makes a committed step unrestorable (issue #38, item 1): every manager's
retention honours the references of incremental steps, whatever its own ``incremental``;
it decides from what is committed when it runs (another manager's steps too); and it
deletes in an order that leaves every listed step whole at any SIGKILL."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.manager.retention_kill_worker import tree
from tests.manager.test_deleters_race import run_url  # noqa: F401 - the fixture: local, gs, s3
from tests.saving.test_save_integrity import Sabotage
from tpu_ckpt import catalog, storage
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE


def assert_listed_steps_restore(url: str, trees: dict[int, dict] | None = None) -> list[int]:
    """Every step a fresh listing of ``url`` commits restores bit-exactly (``tree(step)``, or ``trees[step]``)."""
    steps = sorted(catalog.list_run(storage.location(url)).committed)
    for step in steps:
        restored = tc.restore(storage.location(url).child(f"step_{step}"))
        expected = tree(step) if trees is None else trees[step]
        for key, value in expected.items():
            assert np.asarray(restored[key]).tobytes() == np.asarray(value).tobytes(), (step, key)
    return steps


def save_incrementally(url: str, steps) -> None:
    with tc.CheckpointManager(url, max_to_keep=None, incremental=True) as manager:
        for step in steps:
            manager.save(step, tree(step))


def test_a_restart_without_incremental_keeps_the_kept_steps_restorable(run_url):  # noqa: F811
    save_incrementally(run_url, range(1, 5))  # 2..4 reference step 1's "a" (and 4 step 3's "b")
    with tc.CheckpointManager(run_url, max_to_keep=2) as manager:
        manager.save(5, tree(5))
        assert manager.all_steps() == [4, 5]
    assert assert_listed_steps_restore(run_url) == [4, 5]
    listing = catalog.list_run(storage.location(run_url))
    assert listing.retired == ["step_1", "step_3"]  # step 4 still reads their files; step 2 is gone
    with tc.CheckpointManager(run_url, max_to_keep=2) as manager:
        manager.save(6, tree(6))
    assert assert_listed_steps_restore(run_url) == [5, 6]
    listing = catalog.list_run(storage.location(run_url))
    assert listing.retired == [] and listing.leftovers == []  # no kept step references any more


def test_a_step_another_manager_committed_keeps_what_it_references(tmp_path):
    """Manager B lists the run (steps 1 and 2) and saves step 4; while its save runs, manager
    A commits step 3, referencing step 1. B's retention still sees step 3 and keeps step 1's
    files (retired), though its own listing let step 1 go."""
    url = str(tmp_path)
    a = tc.CheckpointManager(url, max_to_keep=None, incremental=True)
    a.save(1, tree(1))
    a.save(2, tree(2))
    sabotage = Sabotage(lambda: True, lambda: a.save(3, tree(3)))
    with tc.CheckpointManager(url, max_to_keep=2, options=tc.CheckpointOptions(sharding_callback=sabotage)) as b:
        b.save(4, tree(4))
    assert sabotage.acted
    assert assert_listed_steps_restore(url) == [3, 4]
    assert sorted(os.listdir(tmp_path / "step_1")) == ["d00000-00000.safetensors", REFERENCED_FILE]
    a.close()


@pytest.mark.slow
def test_sigkill_at_every_deletion_of_retention_leaves_every_listed_step_restorable(tmp_path):
    """A restarted job (no ``incremental``) saves steps 5 and 6 into a run saved incrementally
    (steps 1 to 4) and is killed at its first deletion, then its second, and so on until it
    finishes: after each kill every listed step restores bit-exactly, and the next save of a
    fresh manager leaves only committed steps and the retired ones they reference."""
    template = str(tmp_path / "template")
    save_incrementally(template, range(1, 5))
    worker = os.path.join(os.path.dirname(__file__), "retention_kill_worker.py")
    for kill_at in range(1, 40):
        run = str(tmp_path / f"run_{kill_at}")
        shutil.copytree(template, run)
        done = subprocess.run([sys.executable, worker, run, str(kill_at)], capture_output=True, text=True, timeout=300)
        assert done.returncode in (0, -9), done.stderr
        assert assert_listed_steps_restore(run), kill_at
        with tc.CheckpointManager(run, max_to_keep=2) as manager:
            manager.save(9, tree(9))
        assert assert_listed_steps_restore(run)[-1] == 9
        for name in os.listdir(run):
            assert {MANIFEST_FILE, REFERENCED_FILE} & set(os.listdir(os.path.join(run, name))), (kill_at, name)
        if done.returncode == 0:
            assert done.stdout.startswith("DONE") and kill_at > 5, done.stdout
            return
    pytest.fail("the worker never finished")


@pytest.mark.slow
@pytest.mark.parametrize("a_incremental", [True, False], ids=["a_incremental", "a_full"])
def test_two_managers_interleaving_async_and_sync_saves_lose_no_acknowledged_step(run_url, a_incremental):  # noqa: F811
    """Manager A saves asynchronously, manager B synchronously (one of them incremental), both
    with max_to_keep=2 on one run, 10 rounds: B lists the run while A's save is in flight. After
    every round each listed step restores, and the two newest acknowledged steps are listed."""
    url = run_url
    a = tc.CheckpointManager(
        url, max_to_keep=2, incremental=a_incremental, options=tc.CheckpointOptions(enable_async=True)
    )
    b = tc.CheckpointManager(url, max_to_keep=2, incremental=not a_incremental)
    acknowledged = []
    for round_ in range(10):
        a.save(2 * round_, tree(2 * round_))
        b.save(2 * round_ + 1, tree(2 * round_ + 1))  # listed while A's save was in flight
        acknowledged.append(2 * round_ + 1)
        a.wait_until_finished()
        acknowledged.append(2 * round_)
        listed = assert_listed_steps_restore(url)
        assert set(sorted(acknowledged)[-2:]) <= set(listed), (round_, listed)
    a.close()
    b.close()


@pytest.mark.parametrize("prefix", ["run/", ""])
def test_an_object_listing_around_known_steps_lists_only_the_others(prefix):
    """What retention lists on an object store (RunDirectory.current): every key but those of the known steps."""
    loc = storage.location(f"memory://around-{len(prefix)}/{prefix}")
    names = ["a.json", "step_1/x", "step_10/x", "step_1a/x", "step_2/manifest.json", "step_2/y", "step_3/z", "zz/w"]
    with storage.Store(loc, threads=1) as store:
        for name in names:
            store.write(name, [b"1"]).result()
        assert store.list() == names
        assert store.list(outside=["step_1", "step_2"]) == ["a.json", "step_10/x", "step_1a/x", "step_3/z", "zz/w"]
        assert store.list(outside=["zz", "a.json", "step_3"]) == [
            n for n in names if not n.startswith(("zz/", "step_3/"))
        ]
