"""What a process sends the leader for its per-process values: sizes, crc32c and digests, never
the values (a 16 MiB value per process must not go through the coordination service)."""

import json
import os

import numpy as np

import tpu_ckpt as tc
from tpu_ckpt import storage
from tpu_ckpt.saving import plan_save
from tpu_ckpt.saving._per_process import write_values


def test_a_16_mib_value_sends_the_leader_a_few_bytes(tmp_path):
    value = {"grain": os.urandom(16 << 20), "positions": np.arange(1000)}
    plan = plan_save(
        {"it": tc.PerProcess(value), "config": {"lr": 0.1, "name": "x" * 1000}}, process_index=3, process_count=4
    )
    with storage.Store(storage.location(str(tmp_path))) as store:
        record = write_values(store, plan.manifest, plan.host_digests, 3, "")
    assert len(record) < 200  # the coordination service sees this, and nothing else
    doc = json.loads(record)
    name, size = doc["file"]
    assert name == "values-00003.bin" and (tmp_path / name).stat().st_size == size
    assert size < (16 << 20) * 1.01  # the value's bytes plus a small header: no text encoding
    assert len(doc["digests"]) == 2 and all(len(d) == 16 for d in doc["digests"])
