"""An Orbax Composite step's JSON items (ocp.args.JsonSave: a data iterator's state, a
config) come into the imported tree, and relative paths work, with real Orbax."""

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tpu_ckpt as tc
from tests.interop.test_orbax_interop import abstract, assert_bit_exact, make_state
from tpu_ckpt import cli
from tpu_ckpt.interop import _orbax_items

CONFIG = {"lr": 0.001, "layers": 4, "name": "lm-1b", "bf16": True, "warmup": None, "schedule": [[0, 1.0], [100, 0.1]]}
ITERATOR = {"next_index": 96, "epoch": 2, "seed": 1234567890123}


def orbax_run(directory, state, steps=(10, 20)):
    """An Orbax CheckpointManager run saving the state and two JSON items at each step."""
    with ocp.CheckpointManager(directory) as manager:
        for step in steps:
            iterator = {**ITERATOR, "next_index": step * 8}
            args = ocp.args.Composite(
                state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(CONFIG),
                iterator=ocp.args.JsonSave(iterator),
            )
            manager.save(step, args=args)
        manager.wait_until_finished()


@pytest.fixture(scope="module")
def state(mesh42):
    return make_state(mesh42, steps=1)


def test_a_composite_run_imports_with_its_json_items_from_relative_paths(state, tmp_path, monkeypatch):
    orbax_run(tmp_path / "orbax", state)
    monkeypatch.chdir(tmp_path)
    reports = tc.import_orbax("orbax", "tc")
    assert [(r.step, r.skipped) for r in reports] == [(10, False), (20, False)]
    with tc.CheckpointManager("tc") as manager:
        assert manager.all_steps() == [10, 20]
        restored = manager.restore(20)
    assert restored["config"] == CONFIG and restored["iterator"] == {**ITERATOR, "next_index": 160}
    assert type(restored["iterator"]["seed"]) is int and type(restored["config"]["lr"]) is float
    assert_bit_exact(tc.restore("tc/step_20", abstract(state), subtree="state"), state)
    # One step, and the command, from relative paths too.
    [one] = tc.import_orbax(os.path.join("orbax", "10"), "one")
    assert one.step is None and tc.restore("one")["iterator"]["next_index"] == 80
    assert cli.main(["import-orbax", "orbax", "by_cli"]) == 0
    assert tc.restore(os.path.join("by_cli", "step_10"))["config"] == CONFIG


def test_export_and_import_of_a_lone_checkpoint_take_relative_paths(state, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tc.save("ours", {"w": jnp.arange(8, dtype=jnp.float32), "step": 3})
    assert tc.export_orbax("ours", "theirs") == ["theirs"]
    [report] = tc.import_orbax("theirs", "back")
    restored = tc.restore(report.dst)
    np.testing.assert_array_equal(restored["w"], np.arange(8, dtype=np.float32))
    assert restored["step"] == 3


def test_an_empty_list_in_a_json_item_is_left_out_with_a_warning(tmp_path, caplog):
    with ocp.CheckpointManager(tmp_path / "orbax") as manager:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave({"w": np.ones(4, np.float32)}),
            iterator=ocp.args.JsonSave({"buffer": [], "i": 1}),
        )
        manager.save(0, args=args)
        manager.wait_until_finished()
    with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
        [report] = tc.import_orbax(tmp_path / "orbax", tmp_path / "tc")
    assert tc.restore(report.dst)["iterator"] == {"i": 1}
    assert any("'iterator' holds an empty list at '/buffer'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("damage", ["fifo", "huge", "outside"])
def test_a_damaged_json_item_is_refused_before_orbax_reads_it(tmp_path, damage):
    with ocp.CheckpointManager(tmp_path / "orbax") as manager:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave({"w": np.ones(4, np.float32)}), config=ocp.args.JsonSave(CONFIG)
        )
        manager.save(0, args=args)
        manager.wait_until_finished()
    [name] = [f for f in os.listdir(tmp_path / "orbax" / "0" / "config") if "commit" not in f]
    path = tmp_path / "orbax" / "0" / "config" / name
    if damage == "outside":  # the step's metadata names a JSON item out of the step
        metadata = tmp_path / "orbax" / "0" / "_CHECKPOINT_METADATA"
        record = json.loads(metadata.read_text())
        record["item_handlers"]["../../config"] = record["item_handlers"].pop("config")
        metadata.write_text(json.dumps(record))
        (tmp_path / "config").mkdir()
    elif damage == "fifo":
        path.unlink()
        os.mkfifo(path)  # Orbax would wait on it forever
    else:
        path.unlink()
        with open(path, "wb") as f:
            f.truncate(_orbax_items.MAX_JSON_ITEM_BYTES + 1)
    with pytest.raises(tc.CorruptCheckpointError, match="config"):
        tc.import_orbax(tmp_path / "orbax", tmp_path / "tc")
    assert not (tmp_path / "tc" / "step_0").exists()
