"""Measures peak host memory of a sync save, an async save and a restore under
``host_memory_limit``, in a fresh process (for test_memory.py).

Prints one JSON line: the state's bytes, and for each operation the peak RSS above the RSS
before it (VmHWM after a reset through /proc/self/clear_refs, free heap pages trimmed first).
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=32"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpu_ckpt as tc  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from rss import measured  # noqa: E402  (tests/support/rss.py)

directory, megabytes, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mesh = jax.make_mesh((8, 4), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
n = megabytes * (1 << 20) // 4
x = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32).reshape(-1, 1024), out_shardings=sharding)()
x.block_until_ready()
bounded = tc.CheckpointOptions(host_memory_limit=limit)
tc.save(os.path.join(directory, "warmup"), {"x": jnp.ones(8)}, options=bounded.replace(enable_async=True)).wait()
out = {"state_bytes": n * 4}


measured(out, "sync_save", lambda: tc.save(os.path.join(directory, "sync"), {"x": x}, options=bounded))
measured(out, "async_save",
         lambda: tc.save(os.path.join(directory, "async"), {"x": x}, options=bounded.replace(enable_async=True)).wait())
target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
restored = measured(out, "restore", lambda: tc.restore(os.path.join(directory, "async"), target, options=bounded))
out["restored_exactly"] = all(
    np.array_equal(np.asarray(a.data), np.asarray(b.data))
    for a, b in zip(restored["x"].addressable_shards, x.addressable_shards)
)
out["files"] = len([f for f in os.listdir(os.path.join(directory, "async")) if f.endswith(".safetensors")])
print(json.dumps(out))
