"""Run by test_incremental.py in every process of a 2-process job (tests/mp_scenarios.exec_file):
an incremental manager loop over a sharded frozen base and a sharded trained part; every
kept step must restore, and each save after the first must write only the trained part.
With a file ``io_device`` in the directory, process 1 writes for both (``io_device=1``)."""

import json
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc

mesh = jax.make_mesh((jax.device_count(),), ("x",))
sharding = NamedSharding(mesh, P("x"))


def global_array(value: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


BASE = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
base = global_array(BASE)


def trained(step: int) -> np.ndarray:
    return np.full((64, 8), step, np.float32)


written = {}
options = tc.CheckpointOptions(io_device=1) if os.path.exists("io_device") else None  # the test's switch
with tc.CheckpointManager("run", max_to_keep=2, incremental=True, options=options) as manager:
    for step in range(4):
        manager.save(step, {"base": base, "trained": global_array(trained(step)), "step": step})
        manager.wait_until_finished()
        if jax.process_index() == 0:
            d = os.path.join("run", f"step_{step}")
            written[step] = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f != "manifest.json")
    steps = manager.all_steps()
    for step in steps:
        restored = manager.restore(step, {"base": base, "trained": global_array(trained(0)), "step": 0})
        for key, value in (("base", BASE), ("trained", trained(step))):
            for shard in restored[key].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
if jax.process_index() == 0:
    with open("result.json", "w") as f:
        json.dump({"steps": steps, "written": written}, f)
