"""Measures peak host memory of one save and one restore in a fresh process (for test_memory).

Prints one JSON line: baseline RSS, and the peak RSS above it during save and restore.
Peaks are read from VmHWM after resetting it through /proc/self/clear_refs.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpu_ckpt as tc  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from rss import reset_peak, rss  # noqa: E402  (tests/support/rss.py)

directory, megabytes = sys.argv[1], int(sys.argv[2])
mesh = jax.make_mesh((4, 2), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
n = megabytes * (1 << 20) // 4
x = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32).reshape(-1, 1024), out_shardings=sharding)()
x.block_until_ready()
tc.save(os.path.join(directory, "warmup"), {"x": jnp.ones(8)})
reset_peak()
base = rss("VmRSS")
tc.save(os.path.join(directory, "c"), {"x": x})
save_peak = rss("VmHWM") - base
target = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
del x
reset_peak()
base_restore = rss("VmRSS")
restored = tc.restore(os.path.join(directory, "c"), {"x": target})
restored["x"].block_until_ready()
restore_peak = rss("VmHWM") - base_restore
print(json.dumps({"state_bytes": n * 4, "save_peak": save_peak, "restore_peak": restore_peak}))
