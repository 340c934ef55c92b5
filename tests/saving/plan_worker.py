"""One process of a multi-process planning test: plans a save, then carries it out.

Run by tests/test_save_plan.py through ``multiprocess.run_script`` (it needs JAX's
distributed runtime, like tests/support/mp_worker.py, but no scenario of tests/support/mp_scenarios.py).
Prints ``RESULT <json>``: the data files this process's plan writes (name -> pieces as
``[key, slice, nbytes]``) and the log line of the save that carried the plan out.
"""

import json
import logging
import os
import sys

import jax

port, num_processes, process_id, directory = sys.argv[1:]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(num_processes), process_id=int(process_id))

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpu_ckpt as tc  # noqa: E402
from tpu_ckpt.saving import plan_save  # noqa: E402


def global_array(mesh: jax.sharding.Mesh, spec: P, value: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


mesh = jax.make_mesh((4, 2), ("data", "model"))
tree = {
    "w": global_array(mesh, P("data", "model"), np.arange(16 * 8, dtype=np.float32).reshape(16, 8)),
    "replicated": global_array(mesh, P(), np.arange(6, dtype=np.int32)),
    "big_replicated": global_array(mesh, P(), np.arange(2 << 20, dtype=np.float32).reshape(1024, 2048)),
    "host": np.arange(10.0),
    "step": 7,
}
plan = plan_save(tree)
files = {f.name: [[p.key, p.slice, p.nbytes] for p in f.pieces] for f in plan.files}
lines = Lines()
logging.getLogger("tpu_ckpt.saving._save").addHandler(lines)
logging.getLogger("tpu_ckpt.saving._save").setLevel(logging.INFO)
tc.save(os.path.join(directory, "ckpt"), tree).wait()
print("RESULT " + json.dumps({"process": jax.process_index(), "files": files, "log": lines.lines}), flush=True)
jax.distributed.shutdown()
