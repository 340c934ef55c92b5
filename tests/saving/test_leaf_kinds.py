"""Bytes and tc.PerProcess leaves through save, restore, metadata, inspect and the manager."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import tpu_ckpt as tc


def test_bytes_leaves_come_back_as_bytes_stored_outside_the_manifest(tmp_path):
    big = os.urandom(1 << 20)
    tree = {"state": big, "ba": bytearray(b"abc"), "mv": memoryview(b"read-only"), "empty": b""}
    tc.save(tmp_path / "c", tree).wait()
    assert (tmp_path / "c" / "manifest.json").stat().st_size < 4096  # the megabyte lives in a data file
    back = tc.restore(tmp_path / "c")
    assert back == {"state": big, "ba": b"abc", "mv": b"read-only", "empty": b""}
    assert all(type(v) is bytes for v in back.values())
    assert tc.restore(tmp_path / "c", {"state": b""}) == {"state": big}  # a bytes target


def test_a_damaged_bytes_leaf_fails_its_crc(tmp_path):
    tc.save(tmp_path / "c", {"state": b"x" * 1000}).wait()
    data = next(p for p in (tmp_path / "c").iterdir() if p.name.endswith(".safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(tc.CorruptCheckpointError, match="state"):
        tc.restore(tmp_path / "c")


def test_per_process_value_round_trips_plain(tmp_path):
    value = {
        "next_index": 96, "grain": b"\x00\x01" * 100, "seen": np.arange(5, dtype=np.int16), "t": (1, 2.5, None, "s")
    }
    tc.save(tmp_path / "c", {"it": tc.PerProcess(value), "w": np.ones(2)}).wait()
    back = tc.restore(tmp_path / "c")["it"]
    assert back.keys() == value.keys() and back["grain"] == value["grain"] and back["t"] == value["t"]
    np.testing.assert_array_equal(back["seen"], value["seen"])
    assert back["seen"].dtype == np.int16
    assert tc.restore(tmp_path / "c", {"it": tc.PerProcess()})["it"]["next_index"] == 96
    meta = tc.metadata(tmp_path / "c")["it"]
    assert isinstance(meta, tc.PerProcessMetadata) and meta.process_count == 1 and meta.sizes[0] > 200
    shown = subprocess.run(
        [sys.executable, "-m", "tpu_ckpt", "inspect", str(tmp_path / "c")], capture_output=True, text=True
    )
    assert "per-process" in shown.stdout and "1 process" in shown.stdout
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "tpu_ckpt", "inspect", "--json", str(tmp_path / "c")], capture_output=True, text=True
    ).stdout)
    assert [leaf for leaf in doc["leaves"] if leaf["key"] == "it"] == [
        {"key": "it", "kind": "per_process", "process_count": 1, "sizes": list(meta.sizes)}
    ]
    verified = subprocess.run(
        [sys.executable, "-m", "tpu_ckpt", "verify", str(tmp_path / "c")], capture_output=True, text=True
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_reshard_runs_with_the_same_count_only_when_asked(tmp_path):
    tc.save(tmp_path / "c", {"it": tc.PerProcess(5)}).wait()
    back = tc.restore(tmp_path / "c", {"it": tc.PerProcess(reshard=lambda values, me, count: ("resharded", values))})
    assert back == {"it": 5}  # same process count: the process's own value, the function unused


def test_a_value_that_cannot_be_stored_names_key_and_process(tmp_path):
    with pytest.raises(TypeError, match=r"'it' on process 0 holds a object"):
        tc.save(tmp_path / "c", {"it": tc.PerProcess({"bad": object()})})
    with pytest.raises(TypeError, match=r"'it' on process 0 .*jax.Array"):
        tc.save(tmp_path / "d", {"it": tc.PerProcess(jax.numpy.ones(2))})
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_manager_async_save_keeps_the_value_given(tmp_path):
    state = {"next_index": 1}
    with tc.CheckpointManager(tmp_path / "run", options=tc.CheckpointOptions(enable_async=True)) as manager:
        manager.save(0, {"it": tc.PerProcess(state), "w": np.zeros(4)})
        state["next_index"] = 999  # changed while the save may still be writing
        manager.wait_until_finished()
        assert manager.restore(0)["it"] == {"next_index": 1}


def test_serving_export_drops_per_process_values(tmp_path):
    tc.save(tmp_path / "c", {"params": {"w": np.ones(3, np.float32)}, "it": tc.PerProcess({"i": 1})}).wait()
    tc.export_for_serving(tmp_path / "c", tmp_path / "s")
    assert set(tc.restore(tmp_path / "s")) == {"w"}


def test_the_local_tier_carries_per_process_values(tmp_path):
    """Local steps 1 and 2 (step 1 also uploaded): step 2 comes from the local tier with its value
    (tests/tiers/test_local_per_process.py: replicas, lost hosts and resharding, 2 processes)."""
    with tc.CheckpointManager(tmp_path / "run", save_interval_steps=10, local_directory=tmp_path / "local") as manager:
        for step in (1, 2):
            manager.save(step, {"it": tc.PerProcess({"step": step, "state": b"s" * step}), "w": np.zeros(2)})
        manager.wait_until_finished()
        assert manager.all_steps() == [1] and "values-00000.bin" in os.listdir(tmp_path / "local" / "step_2")
        assert manager.restore(None, {"it": tc.PerProcess(), "w": np.ones(2)})["it"] == {"step": 2, "state": b"ss"}
    assert tc.restore(tmp_path / "run" / "step_1")["it"] == {"step": 1, "state": b"s"}


@pytest.mark.parametrize("damage", ["another save's token", "a value claimed at 1 TiB", "a 2**62-byte record"])
def test_a_damaged_local_values_file_falls_back_to_the_persistent_step(tmp_path, caplog, damage):
    def manager():
        return tc.CheckpointManager(tmp_path / "run", save_interval_steps=10, local_directory=tmp_path / "local")

    with manager() as first:
        for step in (1, 2):
            first.save(step, {"it": tc.PerProcess({"step": step}), "w": np.zeros(2)})
    path = tmp_path / "local" / "step_2" / "values-00000.bin"
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    record = json.loads(data[8 : 8 + size])
    if damage == "another save's token":
        record["token"] = "0" * 28
    else:
        record["values"][0][1] = 1 << 40
    body = json.dumps(record).encode()
    header = (1 << 62 if damage.startswith("a 2") else len(body)).to_bytes(8, "little")
    path.write_bytes(header + body + data[8 + size :])
    with manager() as second:
        assert second.restore(None, {"it": tc.PerProcess(), "w": np.ones(2)})["it"] == {"step": 1}
    assert any("CorruptCheckpointError" in r.message and "values-00000.bin" in r.message for r in caplog.records)


def test_incremental_saves_carry_per_process_values(tmp_path):
    w = jax.numpy.arange(1024.0)
    with tc.CheckpointManager(tmp_path / "run", incremental=True) as manager:
        for step in range(3):
            manager.save(step, {"w": w, "it": tc.PerProcess({"step": step})})
        manager.wait_until_finished()
        assert [manager.restore(step)["it"] for step in range(3)] == [{"step": 0}, {"step": 1}, {"step": 2}]
