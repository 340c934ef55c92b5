"""One process of a multi-process planning test (tests/saving/test_plan_share.py): plans a
save of leaves sharded over every process, and of leaves each block of which a pair of
processes holds; prints ``RESULT <json>``: the blocks its plan writes, and how many
write-balance decisions planning made (each is work for one block)."""

import json
import sys

import jax

port, num_processes, process_id = sys.argv[1:4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(num_processes), process_id=int(process_id))

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tpu_ckpt.saving import plan_save  # noqa: E402
from tpu_ckpt.sharding import WriteBalance  # noqa: E402

devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
everywhere = jax.sharding.Mesh(devices, ("d",))
pairs = jax.sharding.Mesh(devices.reshape(2, -1), ("pair", "rest"))  # processes 0, 1 and 2, 3 each hold a block


def array(mesh, spec, shape, seed):
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + seed
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda index: value[index])


tree = {
    **{f"sharded{i}": array(everywhere, P("d"), (len(devices) * 4,), i) for i in range(5)},
    **{f"paired{i}": array(pairs, P("pair"), (4 * (i + 1), 3), i) for i in range(6)},
}
decisions = []
real_assign = WriteBalance.assign


def counted(self, holders, nbytes):
    decisions.append(list(holders))
    return real_assign(self, holders, nbytes)


WriteBalance.assign = counted
plan = plan_save(tree)
WriteBalance.assign = real_assign
blocks = [[p.key, [list(s) for s in p.slice], p.nbytes] for f in plan.files for p in f.pieces]
print("RESULT " + json.dumps({"process": jax.process_index(), "blocks": blocks, "decisions": decisions}), flush=True)
jax.distributed.shutdown()
