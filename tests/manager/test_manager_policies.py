"""CheckpointManager where Orbax users expect parity: ``restore(target)``, the save cadence
(TF's interval or Orbax's multiples), continuous saving, and best-k retention by metrics
stored in the manifests. Real saves, real Flax/optax states, no mocks."""

import json
import math
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import tpu_ckpt as tc
from tests.support import process_group
from tests.support.flax_mlp import X, Y, new_state, train_step
from tests.support.helpers import sealed
from tpu_ckpt import cli
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import decode_manifest


def tree(step: int) -> dict:
    return {"w": np.full((4, 2), step, np.float32), "step": step}


def manifest_doc(path) -> dict:
    return json.loads((path / "manifest.json").read_bytes())


def loss_manager(directory, **kwargs):
    return tc.CheckpointManager(directory, best_fn=lambda m: m["loss"], best_mode="min", **kwargs)


# --- restore(target), as Orbax users write it ---


def test_restore_takes_the_target_first_like_orbax(tmp_path):
    state = new_state(optax.adamw(1e-2))
    with tc.CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            state, _ = train_step(state, X, Y)
            manager.save(step, state)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), new_state(optax.adamw(1e-2))
    )
    restored = tc.CheckpointManager(tmp_path).restore(abstract)  # the latest step, into the target
    assert type(restored) is train_state.TrainState and int(restored.step) == 2
    np.testing.assert_array_equal(
        restored.params["params"]["Dense_0"]["kernel"], state.params["params"]["Dense_0"]["kernel"]
    )
    assert int(tc.CheckpointManager(tmp_path).restore(1, abstract).step) == 1


def test_a_state_where_a_step_goes_is_refused_in_one_short_line(tmp_path):
    state = new_state(optax.adamw(1e-2))
    manager = tc.CheckpointManager(tmp_path)
    manager.save(1, state)
    with pytest.raises(TypeError) as swapped:
        manager.save(state, 2)
    with pytest.raises(TypeError) as two_targets:
        manager.restore(state, state)
    for error in (swapped, two_targets):
        message = str(error.value)
        assert "\n" not in message and len(message) < 250, message
    assert "call save(step, tree)" in str(swapped.value)
    assert "restore(target)" in str(two_targets.value)
    with pytest.raises(TypeError, match="step must be an integer"):
        manager.restore(1.0)
    with pytest.raises(TypeError, match="step must be an integer"):
        manager.restore("step_1")


# --- cadence: TF's interval or Orbax's multiples ---


@pytest.mark.parametrize(
    ("on_multiples", "first", "saved"),
    [(False, 1, [1, 11, 21]), (True, 1, [10, 20]), (True, 0, [0, 10, 20]), (False, 0, [0, 10, 20])],
)
def test_save_interval_counts_from_the_first_save_or_from_multiples(tmp_path, on_multiples, first, saved):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=None, save_interval_steps=10, save_on_multiples=on_multiples)
    for step in range(first, 26):
        assert manager.save(step, tree(step)) == (step in saved)
    assert manager.all_steps() == saved


def test_multiples_after_a_restart_resume_at_the_next_multiple(tmp_path):
    with tc.CheckpointManager(tmp_path, save_interval_steps=10, save_on_multiples=True) as manager:
        for step in range(1, 24):
            manager.save(step, tree(step))
    manager = tc.CheckpointManager(tmp_path, save_interval_steps=10, save_on_multiples=True)
    assert manager.restore()["step"] == 20
    assert not manager.should_save(20)  # restored: not saved again
    assert [step for step in range(20, 41) if manager.save(step, tree(step))] == [30, 40]


# --- continuous saving: whenever no save is in flight, at most every N seconds ---


def test_continuous_saving_skips_steps_while_an_async_save_is_in_flight(tmp_path):
    release = threading.Event()
    options = tc.CheckpointOptions(enable_async=True, write_callbacks=(lambda: release.wait(),))
    state = new_state(optax.adamw(1e-2))
    manager = tc.CheckpointManager(tmp_path, max_to_keep=None, save_interval_seconds=0, options=options)
    saved = []
    try:
        for step in range(1, 6):
            state, _ = train_step(state, X, Y)
            if manager.save(step, state):
                saved.append(step)
        assert saved == [1]  # steps 2..5: the save of step 1 was still in flight
        assert not manager.should_save(6)
    finally:
        release.set()
    manager.wait_until_finished()
    assert manager.should_save(6) and manager.save(6, state)
    manager.close()
    assert manager.all_steps() == [1, 6]


def test_continuous_saving_with_an_interval_counts_from_the_last_save_or_restore(tmp_path):
    manager = tc.CheckpointManager(tmp_path, save_interval_seconds=3600)
    assert manager.save(1, tree(1))  # a manager's first save is due
    assert not manager.should_save(2) and not manager.save(2, tree(2))
    assert manager.save(2, tree(2), force=True)
    later = tc.CheckpointManager(tmp_path, save_interval_seconds=3600)
    later.restore()
    assert not later.should_save(3)  # the restore started the clock
    assert tc.CheckpointManager(tmp_path, save_interval_seconds=3600).should_save(3)


def test_continuous_saving_and_the_step_interval_must_both_agree(tmp_path):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=None, save_interval_steps=3, save_interval_seconds=0)
    assert [step for step in range(1, 10) if manager.save(step, tree(step))] == [1, 4, 7]


CONTINUOUS_WORKER = """
import json, sys, time
import jax
import numpy as np

port, count, me, directory = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(count), process_id=int(me))
import tpu_ckpt as tc

slow = (lambda: time.sleep(0.05)) if int(me) == 1 else (lambda: None)  # its saves stay in flight longer
options = tc.CheckpointOptions(enable_async=True, write_callbacks=(slow,))
saved = []
with tc.CheckpointManager(directory, max_to_keep=None, save_interval_seconds=0, options=options) as manager:
    for step in range(30):
        if manager.save(step, {"x": np.full(2, step)}):
            saved.append(step)
        time.sleep(0.005)
print("SAVED", json.dumps(saved), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.multiprocess
def test_processes_agree_on_continuous_saves_though_their_saves_finish_at_different_times(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(CONTINUOUS_WORKER)
    outputs = [r.output for r in process_group.run_script(str(script), 2, str(tmp_path / "ckpts"), timeout=120)]
    found = [re.search(r"SAVED (\[.*\])", out) for out in outputs]
    assert all(found), outputs
    saved = [json.loads(m.group(1)) for m in found]
    assert saved[0] == saved[1] and saved[0][0] == 0, outputs
    assert tc.CheckpointManager(tmp_path / "ckpts").all_steps() == saved[0]


# --- best-k retention by metrics ---


def test_keep_best_keeps_the_best_by_metric_besides_the_newest(tmp_path):
    manager = loss_manager(tmp_path, max_to_keep=2, keep_best=2)
    kept = []
    for step, loss in [(1, 5.0), (2, 1.0), (3, 3.0), (4, 0.5), (5, 9.0), (6, 8.0), (7, 7.0)]:
        manager.save(step, tree(step), metrics={"loss": loss})
        kept.append(manager.all_steps())
    # The newest two, plus the two lowest losses.
    assert kept == [[1], [1, 2], [2, 3], [2, 3, 4], [2, 4, 5], [2, 4, 5, 6], [2, 4, 6, 7]]


def test_the_step_just_saved_is_kept_however_bad_its_metric(tmp_path):
    manager = tc.CheckpointManager(tmp_path, max_to_keep=1, keep_best=1, best_fn=lambda m: m["accuracy"])  # "max"
    for step, accuracy in [(1, 0.9), (2, 0.5), (3, 0.4), (4, 0.95)]:
        manager.save(step, tree(step), metrics={"accuracy": accuracy})
        assert step in manager.all_steps()
    assert manager.all_steps() == [4]


def test_best_steps_survive_restarts_their_metrics_read_back_from_the_manifests(tmp_path):
    state = new_state(optax.adamw(1e-2))
    losses = {}
    with loss_manager(tmp_path, max_to_keep=1, keep_best=2) as manager:
        for step in range(1, 5):
            state, loss = train_step(state, X, Y)
            losses[step] = float(loss)
            manager.save(step, state, metrics={"loss": loss, "epoch": step})  # a JAX scalar straight from jit
    assert manifest_doc(tmp_path / "step_4")["metrics"] == {"loss": losses[4], "epoch": 4}
    # Training diverges after a restart: a new manager, knowing nothing, ranks the old steps.
    with loss_manager(tmp_path, max_to_keep=1, keep_best=2) as manager:
        manager.save(5, state, metrics={"loss": 1e6})
        manager.save(6, state, metrics={"loss": float("nan")})  # NaN ranks nowhere
    assert tc.CheckpointManager(tmp_path).all_steps() == [3, 4, 6]
    assert losses[3] > losses[4]  # training went down: 3 and 4 are the best


def test_steps_without_metrics_are_kept_by_recency_alone(tmp_path):
    manager = loss_manager(tmp_path, max_to_keep=1, keep_best=1)
    manager.save(1, tree(1), metrics={"loss": 2.0})
    manager.save(2, tree(2))
    manager.save(3, tree(3))
    assert manager.all_steps() == [1, 3]
    assert "metrics" not in manifest_doc(tmp_path / "step_3")


def test_best_arguments_are_checked_and_a_broken_best_fn_fails_at_save(tmp_path):
    with pytest.raises(ValueError, match="keep_best=3, max_to_keep=1"):
        tc.CheckpointManager(tmp_path, best_fn=lambda m: m["loss"])  # Orbax's habit, without keep_best
    with pytest.raises(ValueError, match="best_mode"):
        tc.CheckpointManager(tmp_path, keep_best=1, best_fn=lambda m: m["loss"], best_mode="lowest")
    with pytest.raises(ValueError, match="max_to_keep=None"):
        loss_manager(tmp_path, keep_best=1, max_to_keep=None)
    with pytest.raises(ValueError, match="needs best_fn"):
        tc.CheckpointManager(tmp_path, keep_best=1)
    manager = loss_manager(tmp_path, keep_best=1)
    with pytest.raises(TypeError, match="best_fn failed on the metrics of step 1"):
        manager.save(1, tree(1), metrics={"accuracy": 0.5})
    with pytest.raises(TypeError, match="metric 'done' must be a number"):
        manager.save(1, tree(1), metrics={"done": True})
    with pytest.raises(TypeError, match="metric 'loss' must be a number"):
        manager.save(1, tree(1), metrics={"loss": np.zeros(3)})
    assert manager.all_steps() == []  # nothing was written


def test_ls_shows_the_metrics(tmp_path, capsys):
    with tc.CheckpointManager(tmp_path) as manager:
        manager.save(1, tree(1), metrics={"loss": 0.125, "epoch": 3})
        manager.save(2, tree(2))
    assert cli.main(["ls", str(tmp_path)]) == 0
    header, first, second = capsys.readouterr().out.splitlines()
    assert header.split()[-1] == "METRICS"
    assert first.split()[-2:] == ["loss=0.125", "epoch=3"] and second.split()[-1] == "-"
    assert cli.main(["ls", str(tmp_path), "--json"]) == 0
    assert [e["metrics"] for e in json.loads(capsys.readouterr().out)] == [{"loss": 0.125, "epoch": 3}, None]


# --- the manifest's metrics field, decoded strictly ---


def resealed(path, metrics) -> bytes:
    doc = manifest_doc(path)
    doc["metrics"] = metrics
    return sealed(doc)


def test_manifest_metrics_round_trip_non_finite_numbers(tmp_path):
    tc.save(tmp_path / "c", tree(1), metrics={"loss": float("inf"), "grad_norm": float("nan"), "big": 2**62})
    manifest = decode_manifest((tmp_path / "c" / "manifest.json").read_bytes(), where="c")
    assert manifest.metrics["loss"] == math.inf and math.isnan(manifest.metrics["grad_norm"])
    assert manifest.metrics["big"] == 2**62


@pytest.mark.parametrize(
    ("metrics", "field"),
    [
        ([1.0], "metrics must be an object"),
        ({"done": True}, "metrics['done'] must be a number"),
        ({"loss": "0.5"}, "metrics['loss'] must be a number"),
        ({"loss": None}, "metrics['loss'] must be a number"),
        ({"n": 2**64}, "metrics['n'] must be a number"),
        ({f"m{i}": 1 for i in range(1001)}, "metrics must be an object of at most 1000"),
    ],
)
def test_bad_manifest_metrics_are_refused(tmp_path, metrics, field):
    tc.save(tmp_path / "c", tree(1))
    with pytest.raises(CorruptCheckpointError, match=re.escape(field)):
        decode_manifest(resealed(tmp_path / "c", metrics), where="c")

