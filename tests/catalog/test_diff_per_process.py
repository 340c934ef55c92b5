"""diff tells per-process values apart by the crc32c the manifest holds, reading no data file."""

import numpy as np

import tpu_ckpt as tc
from tpu_ckpt.catalog import diff


def test_per_process_values_differ_by_their_crc32c(tmp_path):
    tc.save(tmp_path / "a", {"it": tc.PerProcess({"next_index": 1}), "w": np.ones(2)}).wait()
    tc.save(tmp_path / "b", {"it": tc.PerProcess({"next_index": 2}), "w": np.ones(2)}).wait()
    tc.save(tmp_path / "c", {"it": tc.PerProcess({"next_index": 1}), "w": np.ones(2)}).wait()
    changes = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [(c.kind, c.key) for c in changes] == [("value", "it")]
    assert "per-process values of 1 process (crc32c " in changes[0].before and changes[0].before != changes[0].after
    assert diff(str(tmp_path / "a"), str(tmp_path / "c")) == []
