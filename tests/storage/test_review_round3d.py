"""Review of per-save staging markers and lazy reference checks on object stores (round 3d):
against gcp-storage-emulator and moto."""

from __future__ import annotations

import numpy as np
import pytest

import tpu_ckpt as tc

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
