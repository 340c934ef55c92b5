"""A plain restore counted per process (run by tests/support/process_group.py): the device-to-block
entries it builds, of the job's devices and of this process's."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.mp_scenarios import _global_array, _mismatches
from tpu_ckpt.sharding import _local_indices


def plain_restore_index_entries(directory: str) -> dict:
    """A plain restore onto a target laid out unlike the save (leaves of 6 shapes): the
    device-to-block entries the restore builds, of the job's devices (JAX's global map) and
    of this process's (``sharding.local_indices``), and the values."""
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    flat = jax.sharding.Mesh(devices, ("model",))
    square = jax.sharding.Mesh(devices.reshape(2, -1), ("a", "b"))
    values = {f"w{n}": np.arange(16 * 8 * (n + 1), dtype=np.float32).reshape(16 * (n + 1), 8) for n in range(6)}
    path = os.path.join(directory, "ckpt")
    tc.save(path, {k: _global_array(flat, P("model"), v) for k, v in values.items()})
    targets = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(square, P("b", "a")))
        for k, v in values.items()
    }
    counts = {"global_entries": 0, "local_entries": 0}
    global_map, block_indices = Sharding.devices_indices_map, _local_indices.block_indices

    def counted_global(self, shape):
        found = global_map(self, shape)
        counts["global_entries"] += len(found)
        return found

    def counted_local(*args):
        found = block_indices(*args)
        counts["local_entries"] += len(found)
        return found

    Sharding.devices_indices_map, _local_indices.block_indices = counted_global, counted_local
    try:
        restored = tc.restore(path, targets)
    finally:
        Sharding.devices_indices_map, _local_indices.block_indices = global_map, block_indices
    return {**counts, "mismatches": _mismatches(restored, values)}
