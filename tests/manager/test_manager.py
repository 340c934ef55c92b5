"""CheckpointManager: interval, retention (TF's rules and test cases), leftovers, restore,
async saves and preemption. Real saves into real directories."""

import os
import pathlib
import re
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support import process_group


def tree(step: int) -> dict:
    return {"w": np.full((4, 2), step, np.float32), "step": step}


def entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


def commit_at(directory, step: int, seconds: float) -> None:
    """Sets a step's commit time: the mtime of its manifest."""
    manifest = os.path.join(directory, f"step_{step}", "manifest.json")
    os.utime(manifest, (seconds, seconds))


def leftover(path) -> None:
    """A directory an interrupted save could leave: a data file, no manifest."""
    os.makedirs(path)
    pathlib.Path(path, "d00000-00000.safetensors").write_bytes(b"partial")


# --- interval (TF testCheckpointInterval*) ---


def test_interval_skips_without_writing_and_force_saves(tmp_path):
    manager = tc.CheckpointManager(tmp_path, save_interval_steps=2, max_to_keep=None)
    assert manager.save(0, tree(0))
    assert not manager.save(1, tree(1))
    assert manager.save(2, tree(2))
    assert not manager.save(2, tree(2))  # the same step again
    assert not manager.save(3, tree(3))
    assert entries(tmp_path) == ["step_0", "step_2"]
    assert manager.save(3, tree(3), force=True)
    assert manager.all_steps() == [0, 2, 3]


def test_restore_sets_the_step_the_interval_counts_from(tmp_path):
    with tc.CheckpointManager(tmp_path) as first:
        first.save(1, tree(1))
    manager = tc.CheckpointManager(tmp_path, save_interval_steps=2)
    manager.restore()
    assert not manager.save(1, tree(1)) and not manager.save(2, tree(2))
    assert manager.save(3, tree(3))


def test_a_committed_step_is_never_overwritten(tmp_path):
    manager = tc.CheckpointManager(tmp_path)
    manager.save(5, tree(5))
    with pytest.raises(tc.CheckpointExistsError, match="Step 5 is already committed"):
        manager.save(5, tree(5), force=True)
    with pytest.raises(tc.CheckpointExistsError):
        tc.CheckpointManager(tmp_path).save(5, tree(5))  # a new manager's first save is due
    np.testing.assert_array_equal(manager.restore(5)["w"], tree(5)["w"])


def test_steps_may_be_numpy_or_jax_integers_but_not_anything_else(tmp_path):
    manager = tc.CheckpointManager(tmp_path)
    assert manager.save(np.int64(3), tree(3)) and manager.save(jnp.int32(4), tree(4))
    assert manager.all_steps() == [3, 4]
    with pytest.raises(TypeError, match="step must be an integer"):
        manager.save(5.0, tree(5))
    with pytest.raises(TypeError):
        manager.save(True, tree(5))
    with pytest.raises(ValueError, match=">= 0"):
        manager.save(-1, tree(5))


def test_invalid_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Expected a positive integer or `None` for `max_to_keep`, got 0\."):
        tc.CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="save_interval_steps"):
        tc.CheckpointManager(tmp_path, save_interval_steps=0)
    with pytest.raises(ValueError, match="keep_checkpoint_every_n_hours"):
        tc.CheckpointManager(tmp_path, keep_checkpoint_every_n_hours=-1)
    with pytest.raises(ValueError, match="not local"):
        tc.CheckpointManager("memory://hours", keep_checkpoint_every_n_hours=1)


# --- retention by count (TF testDeletion, testKeepAll, testCustomNumbering) ---


def test_max_to_keep_deletes_the_oldest(tmp_path):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=3)
    for step in range(1, 5):
        manager.save(step, tree(step))
    assert manager.all_steps() == [2, 3, 4] and entries(tmp_path) == ["step_2", "step_3", "step_4"]
    assert manager.latest_step() == 4


def test_keep_all_then_a_later_manager_prunes_on_its_first_save(tmp_path):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=None)
    for step in (1, 2, 3):
        manager.save(step, tree(step))
    tc.CheckpointManager(tmp_path, max_to_keep=None).save(4, tree(4))
    later = tc.CheckpointManager(tmp_path, max_to_keep=3)
    assert later.all_steps() == [1, 2, 3, 4]  # nothing goes until it saves
    later.save(5, tree(5))
    assert later.all_steps() == [3, 4, 5]


def test_any_step_numbers_are_ordered_by_number(tmp_path):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=2)
    for step in range(0, 10, 2):
        manager.save(step, tree(step))
    assert manager.all_steps() == [6, 8]
    manager.save(32, tree(32))
    assert manager.all_steps() == [8, 32] and manager.latest_step() == 32


def test_a_lower_step_is_allowed_and_the_just_saved_step_is_never_deleted(tmp_path):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=3)
    for step in (5, 6, 7):
        manager.save(step, tree(step))
    assert manager.save(3, tree(3), force=True)
    assert manager.all_steps() == [3, 6, 7] and manager.latest_step() == 7


# --- retention by age (TF's keep_checkpoint_every_n_hours, reference §8 and testSaveRestoreState) ---


def test_keep_every_n_hours_matches_tf_with_a_save_every_20_minutes(tmp_path):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1)
    start = int(time.time())  # TF starts the clock when the manager is created (less a second)
    for step in range(1, 9):
        manager.save(step, tree(step))
        commit_at(tmp_path, step, start + 20 * 60 * step)
    assert manager.all_steps() == [3, 6, 7, 8]  # what TF 2.21 keeps (reference §8)


def test_keep_every_n_hours_across_managers_like_tf_save_restore_state(tmp_path):
    first = tc.CheckpointManager(tmp_path, max_to_keep=2)
    first.save(1, tree(1))
    commit_at(tmp_path, 1, 10000)
    first.save(2, tree(2))
    commit_at(tmp_path, 2, 13610)

    second = tc.CheckpointManager(tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1.5)
    assert second.all_steps() == [1, 2]
    second.save(3, tree(3))
    commit_at(tmp_path, 3, 14330)
    assert second.all_steps() == [1, 2, 3]  # step 1 is kept: the first of its 1.5 hours
    second.save(4, tree(4))
    commit_at(tmp_path, 4, 16130)
    assert second.all_steps() == [1, 3, 4]
    second.save(5, tree(5))
    commit_at(tmp_path, 5, 17930)
    assert second.all_steps() == [1, 4, 5]

    third = tc.CheckpointManager(tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1.5)
    third.save(6, tree(6))
    assert third.all_steps() == [1, 4, 5, 6]  # step 4 is 1.5 hours after step 1


# --- the directory is the source of truth ---


def test_a_new_manager_sees_the_committed_steps_and_ignores_other_entries(tmp_path):
    with tc.CheckpointManager(str(tmp_path)) as manager:
        manager.save(1, tree(1))
        manager.save(2, tree(2))
    tc.save(tmp_path / "ckpt-40", tree(40)).wait()  # any name with exactly one integer
    tc.save(tmp_path / "run_1_step_50", tree(50)).wait()  # two integers: not a step
    (tmp_path / "notes_3.txt").write_text("a file, not a checkpoint")
    leftover(tmp_path / "eval_4")  # no manifest, and not a name the manager writes

    reopened = tc.CheckpointManager(tmp_path, max_to_keep=2)
    assert reopened.all_steps() == [1, 2, 40] and reopened.latest_step() == 40
    assert reopened.restore()["step"] == 40
    reopened.save(41, tree(41))
    assert reopened.all_steps() == [40, 41]
    assert entries(tmp_path) == ["ckpt-40", "eval_4", "notes_3.txt", "run_1_step_50", "step_41"]


def test_leftovers_are_not_listed_and_the_next_save_removes_them(tmp_path):
    manager = tc.CheckpointManager(tmp_path)
    manager.save(6, tree(6))
    leftover(tmp_path / "step_7.tmp-abc123")  # an interrupted local save
    leftover(tmp_path / "step_8")  # an interrupted in-place save (object stores)
    manager = tc.CheckpointManager(tmp_path)
    assert manager.all_steps() == [6] and manager.latest_step() == 6
    with pytest.raises(tc.CheckpointNotFoundError, match=r"the committed steps are \[6\]"):
        manager.restore(8)
    assert manager.save(8, tree(8))  # the leftover in its way goes first
    assert entries(tmp_path) == ["step_6", "step_8"]
    assert manager.restore(8)["step"] == 8


def test_the_listing_looks_at_directories_and_their_manifests_only(tmp_path):
    """The manager lists its directory without listing inside the steps: a step is a
    subdirectory whose manifest exists, a file is never one, and an empty ``step_<n>``
    directory is a leftover like any other."""
    (tmp_path / "step_3").write_text("a file, not a checkpoint")
    os.makedirs(tmp_path / "step_4")
    manager = tc.CheckpointManager(tmp_path)
    assert manager.all_steps() == []
    manager.save(6, tree(6))
    assert entries(tmp_path) == ["step_3", "step_6"]


def test_memory_urls_are_listed_through_storage():
    manager = tc.CheckpointManager("memory://manager_test", max_to_keep=2)
    for step in (1, 2, 3):
        manager.save(step, tree(step))
    assert manager.all_steps() == [2, 3]
    assert tc.CheckpointManager("memory://manager_test").restore()["step"] == 3


# --- restore ---


def test_restore_latest_or_a_given_step_with_and_without_target(tmp_path, mesh42, mesh24):
    manager = tc.CheckpointManager(tmp_path)
    for step in (1, 2):
        w = jax.device_put(np.arange(16.0).reshape(8, 2) + step, NamedSharding(mesh42, P("data")))
        manager.save(step, {"w": w, "step": step})
    latest = manager.restore()
    assert latest["step"] == 2 and isinstance(latest["w"], np.ndarray)
    np.testing.assert_array_equal(latest["w"], np.arange(16.0).reshape(8, 2) + 2)

    sharding = NamedSharding(mesh24, P("model"))
    target = {"w": jax.ShapeDtypeStruct((8, 2), np.float64, sharding=sharding), "step": 0}
    first = manager.restore(1, target)
    assert first["step"] == 1 and first["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(first["w"]), np.arange(16.0).reshape(8, 2) + 1)


def test_restore_without_a_checkpoint_raises_not_found(tmp_path):
    manager = tc.CheckpointManager(tmp_path / "empty")
    assert manager.latest_step() is None and manager.all_steps() == []
    with pytest.raises(tc.CheckpointNotFoundError, match="No committed checkpoint in"):
        manager.restore()


# --- asynchronous saves ---


def test_async_saves_with_device_buffers_deleted_at_once(tmp_path, mesh42):
    gates = {"step_1": threading.Event(), "step_2": threading.Event()}
    options = tc.CheckpointOptions(
        enable_async=True, write_callbacks=[lambda path: gates[os.path.basename(path)].wait()]
    )
    manager = tc.CheckpointManager(tmp_path, max_to_keep=1, options=options)
    values = {}
    for step in (1, 2):
        values[step] = np.random.default_rng(step).normal(size=(8, 8)).astype(np.float32)
        x = jax.device_put(values[step], NamedSharding(mesh42, P("data", "model")))
        assert manager.save(step, {"x": x})
        x.delete()
        assert manager.latest_step() == (None if step == 1 else 1)  # in flight: not listed
        gates[f"step_{step}"].set()
    manager.wait_until_finished()
    assert manager.all_steps() == [2]
    np.testing.assert_array_equal(manager.restore()["x"], values[2])


def test_wait_until_finished_reraises_a_background_failure_once(tmp_path):
    def fail():
        raise RuntimeError("callback failed")

    manager = tc.CheckpointManager(tmp_path, options=tc.CheckpointOptions(enable_async=True, write_callbacks=[fail]))
    assert manager.save(1, tree(1))
    with pytest.raises(RuntimeError, match="callback failed"):
        manager.wait_until_finished()
    manager.wait_until_finished()  # reported once
    assert manager.all_steps() == [1]  # the checkpoint itself stays committed


def test_the_next_save_reraises_a_background_failure_and_the_one_after_works(tmp_path):
    calls = []

    def fail_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first callback failed")

    options = tc.CheckpointOptions(enable_async=True, write_callbacks=[fail_once])
    manager = tc.CheckpointManager(tmp_path, options=options)
    manager.save(1, tree(1))
    with pytest.raises(RuntimeError, match="first callback failed"):
        manager.save(2, tree(2))
    assert manager.save(2, tree(2))
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]


def test_the_context_manager_waits_for_the_save_in_flight(tmp_path):
    gate = threading.Event()
    done = []
    options = tc.CheckpointOptions(enable_async=True, write_callbacks=[lambda: gate.wait(), lambda: done.append(1)])
    with tc.CheckpointManager(tmp_path, options=options) as manager:
        manager.save(1, tree(1))
        assert manager.all_steps() == [] and not done
        threading.Timer(0.2, gate.set).start()
    assert done and tc.CheckpointManager(tmp_path).all_steps() == [1]


# --- preemption ---


def test_reached_preemption_after_sigterm_in_a_single_process(tmp_path):
    received = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with tc.CheckpointManager(tmp_path) as manager:
            assert signal.getsignal(signal.SIGTERM) is previous  # nothing installed until asked
            assert not manager.reached_preemption(0)
            os.kill(os.getpid(), signal.SIGTERM)
            assert manager.reached_preemption(1)
            assert manager.save(1, tree(1), force=True)
        assert received == [signal.SIGTERM]  # the handler found before still ran
        assert signal.getsignal(signal.SIGTERM) is previous  # and is back after close()
    finally:
        signal.signal(signal.SIGTERM, original)
    assert tc.CheckpointManager(tmp_path).all_steps() == [1]


def test_reached_preemption_must_first_be_asked_on_the_main_thread(tmp_path):
    errors = []

    def ask():
        try:
            tc.CheckpointManager(tmp_path).reached_preemption(0)
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


PREEMPTION_WORKER = """
import os, signal, sys, time
import jax
import numpy as np

port, count, me, directory = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(count), process_id=int(me))
import tpu_ckpt as tc

options = tc.CheckpointOptions(enable_async=True)
with tc.CheckpointManager(directory, max_to_keep=2, save_interval_steps=10, options=options) as manager:
    for step in range(2000):
        if step == 25 and int(me) == int(count) - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # only the last process is told
        if manager.reached_preemption(step):
            manager.save(step, {"x": np.full(2, step)}, force=True)
            print("PREEMPTED", step, flush=True)
            break
        manager.save(step, {"x": np.full(2, step)})
        time.sleep(0.01)
jax.distributed.shutdown()
"""


@pytest.mark.multiprocess
def test_processes_agree_on_the_preemption_step_through_jax(tmp_path):
    """Two real processes save asynchronously every 10 steps, keeping 2. Only the second
    process gets SIGTERM, and both stop and save at the same step."""
    script = tmp_path / "worker.py"
    script.write_text(PREEMPTION_WORKER)
    outputs = [r.output for r in process_group.run_script(str(script), 2, str(tmp_path / "ckpts"), timeout=120)]
    found = [re.search(r"PREEMPTED (\d+)", out) for out in outputs]
    assert all(found), outputs
    steps = {int(m.group(1)) for m in found}
    (preempted,) = steps
    assert preempted > 25, outputs  # agreed on, after the notice
    manager = tc.CheckpointManager(tmp_path / "ckpts")
    assert manager.all_steps() == [(preempted - 1) // 10 * 10, preempted]
    assert manager.restore()["x"].tolist() == [preempted, preempted]
