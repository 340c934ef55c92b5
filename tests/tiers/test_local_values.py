"""A local step's values file (``tiers/_local_values.py``), read back for an upload: a record
that claims a value past the end of the file is refused before anything that size is read."""

import json

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.format import PLAN_FILE, decode_manifest
from tpu_ckpt.tiers._local_values import own_values


def _local_step(tmp_path):
    with tc.CheckpointManager(tmp_path / "run", save_interval_steps=10, local_directory=tmp_path / "local") as manager:
        for step in (1, 2):
            manager.save(step, {"it": tc.PerProcess({"step": step, "state": b"s" * 64}), "w": np.zeros(2)})
    step_dir = tmp_path / "local" / "step_2"
    return step_dir, decode_manifest((step_dir / PLAN_FILE).read_bytes(), where=PLAN_FILE, tiled=False)


def test_an_upload_takes_its_own_values_back_checked(tmp_path):
    step_dir, plan = _local_step(tmp_path)
    (leaf,) = [leaf for leaf in own_values(str(step_dir), plan, 0).leaves if leaf.key == "it"]
    assert leaf.value  # this process's value, as stored (format.encode_value)


@pytest.mark.parametrize("claim", ["length", "offset"])
def test_a_value_claimed_past_the_file_is_refused_naming_it(tmp_path, claim):
    step_dir, plan = _local_step(tmp_path)
    path = step_dir / "values-00000.bin"
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    record = json.loads(data[8 : 8 + size])
    record["values"][0][1 if claim == "length" else 0] = 1 << 40
    body = json.dumps(record).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + data[8 + size :])
    with pytest.raises(tc.CorruptCheckpointError, match=r"values-00000\.bin: a value is claimed past the file"):
        own_values(str(step_dir), plan, 0)


def test_a_tier_json_without_a_token_is_refused_naming_it(tmp_path):
    step_dir, plan = _local_step(tmp_path)
    (step_dir / "tier.json").write_text("[1, 2]")  # JSON, but not the record a local save writes
    with pytest.raises(tc.CorruptCheckpointError, match=r"tier\.json names no save token"):
        own_values(str(step_dir), plan, 0)
