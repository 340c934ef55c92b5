"""check_restore in a real 2-process JAX job: every process computes every process's reads
from the global shardings, and each process's own entry is what its restore really reads.

``cross_process_reads`` is the scenario each process runs (tests/support/mp_worker.py imports this
module after ``jax.distributed.initialize``)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

W = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)


def cross_process_reads(directory: str) -> dict:
    import tpu_ckpt as tc
    from tpu_ckpt import storage
    from tpu_ckpt.catalog import open_checkpoint
    from tpu_ckpt.restoring import restore_from

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    saved = jax.make_array_from_callback(W.shape, NamedSharding(mesh, P("data", "model")), lambda index: W[index])
    path = os.path.join(directory, "ckpt")
    tc.save(path, {"w": saved}).wait()
    # Columns dealt out one by one over the reversed devices: each process needs half of
    # every saved piece, and reads them all.
    reversed_mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))
    sharding = NamedSharding(reversed_mesh, P(None, ("model", "data")))
    target = {"w": jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=sharding)}
    report = tc.check_restore(path, target)
    with open_checkpoint(storage.location(path)) as checkpoint:
        _, _, nbytes = restore_from(checkpoint, target, tc.CheckpointOptions(), None, None)
    return {
        "me": jax.process_index(), "ok": report.ok, "read": nbytes,
        "bytes": report.bytes_per_process, "over": report.over_read_per_process,
    }


def test_each_process_is_reported_from_the_global_shardings(tmp_path):
    results = process_group.run("multiprocess.test_restore_check_mp.cross_process_reads", 2, str(tmp_path))
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output
    first, second = (r.result for r in results)
    assert first["ok"] and first["bytes"] == second["bytes"] and first["over"] == second["over"]  # JSON: str keys
    for r in (first, second):
        assert r["bytes"][str(r["me"])] == r["read"] == W.nbytes
        assert r["over"][str(r["me"])] == W.nbytes // 2
