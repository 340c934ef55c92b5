"""Measures, in a fresh process on JAX's default backend, the host memory of a sync save (one
host copy at most), and of a save and a restore under ``host_memory_limit`` (for
test_accelerator.py). Prints one JSON line of peak RSS growths, in bytes.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from rss import measured  # noqa: E402  (tests/support/rss.py)

directory, megabytes, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
devices = jax.devices()
mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
rows = megabytes * (1 << 20) // (4 * 1024)
rows -= rows % len(devices)
x = jax.jit(
    lambda: jnp.arange(rows * 1024, dtype=jnp.float32).reshape(rows, 1024), out_shardings=NamedSharding(mesh, P("data"))
)()
x.block_until_ready()
tc.save(os.path.join(directory, "warmup"), {"x": jnp.ones(8)}).wait()
out = {"state_bytes": int(x.nbytes), "platform": devices[0].platform}


bounded = tc.CheckpointOptions(host_memory_limit=limit)
measured(out, "sync_save", lambda: tc.save(os.path.join(directory, "sync"), {"x": x}))
measured(out, "bounded_save", lambda: tc.save(os.path.join(directory, "bounded"), {"x": x}, options=bounded))
target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)}
restored = measured(
    out, "bounded_restore", lambda: tc.restore(os.path.join(directory, "bounded"), target, options=bounded)
)
out["restored_exactly"] = bool(np.array_equal(np.asarray(restored["x"]), np.asarray(x)))
out["restored_on"] = restored["x"].sharding.device_set == x.sharding.device_set
print(json.dumps(out))
