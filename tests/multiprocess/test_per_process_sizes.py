"""#35's target for per-process values, in a real 4-process JAX job (gloo): a 16 MiB value on
each process adds at most 1.1x its bytes to the checkpoint, and never passes through the
coordination service: every value this job's processes set in, or get from, the service's
key-value store stays below 64 KiB (JAX's real client, wrapped to record the sizes).

``sizes_job`` is the scenario each process runs (tests/support/mp_worker.py imports this module after
``jax.distributed.initialize``)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PROCESSES, VALUE_BYTES = 4, 16 << 20
W = np.arange(4096, dtype=np.float32)


def own_value(process: int) -> bytes:
    return np.random.default_rng(process).bytes(VALUE_BYTES)


class _SizeRecordingClient:
    """JAX's real distributed-runtime client; the size of each value set or got is recorded."""

    def __init__(self, client):
        self.client, self.sizes = client, []

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def recorded(*args, **kwargs):
            if name in ("key_value_set", "key_value_set_bytes"):
                self.sizes.append(len(args[1]))
            result = method(*args, **kwargs)
            if isinstance(result, (str, bytes)):
                self.sizes.append(len(result))
            elif isinstance(result, list):  # key_value_dir_get: (key, value) pairs
                self.sizes.extend(len(value) for _, value in result)
            return result

        return recorded


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def sizes_job(directory: str) -> dict:
    from jax._src.distributed import global_state

    import tpu_ckpt as tc

    me = jax.process_index()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    w = jax.make_array_from_callback(W.shape, NamedSharding(mesh, P("x")), lambda i: W[i])
    without, with_values = os.path.join(directory, "without"), os.path.join(directory, "with")
    tc.save(without, {"w": w, "step": 1}).wait()  # the first save into the directory: proved shared here
    real = global_state.client
    global_state.client = recording = _SizeRecordingClient(real)
    try:
        tc.save(
            with_values, {"w": w, "step": 1, "it": tc.PerProcess(own_value(me))},
            options=tc.CheckpointOptions(coordination_timeout=120),
        ).wait()
        back = tc.restore(with_values, {"it": tc.PerProcess()})
    finally:
        global_state.client = real
    return {
        "process": me, "own_back": back["it"] == own_value(me), "calls": len(recording.sizes),
        "largest": max(recording.sizes), "disk": [_disk_bytes(without), _disk_bytes(with_values)],
    }


def test_16_mib_per_process_values_add_their_bytes_and_skip_the_coordination_service(tmp_path):
    results = process_group.run(
        "multiprocess.test_per_process_sizes.sizes_job", PROCESSES, str(tmp_path), timeout=600, devices_per_process=1
    )
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
    for r in results:
        assert r.result["own_back"], r.result
        assert r.result["calls"] > 0  # the save and the restore did go through the wrapped client
        assert r.result["largest"] < 64 << 10, r.result  # no value, nor any of its bytes in bulk, in the service
    without, with_values = results[0].result["disk"]
    added = with_values - without
    assert PROCESSES * VALUE_BYTES <= added <= 1.1 * PROCESSES * VALUE_BYTES, (without, with_values)
    names = sorted(os.listdir(tmp_path / "with"))
    assert [n for n in names if n.startswith("values-")] == [f"values-{p:05d}.bin" for p in range(PROCESSES)], names
