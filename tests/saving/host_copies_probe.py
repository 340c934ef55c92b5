"""Measures the host memory of one asynchronous save in a fresh process (for test_host_copies).

Prints one JSON line: the state's bytes, the RSS growth when ``save`` returned, its peak until ``wait()`` returned, and
what is left after; then the same for a second save of the same state (whose snapshot reuses the first one's buffers
unless ``no-reuse`` is passed). Peaks are read from VmHWM after resetting it through /proc/self/clear_refs. Shards are
64 MiB, above glibc's largest mmap threshold, so a freed host copy leaves RSS at once instead of waiting in the
allocator's free lists.
"""

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpu_ckpt as tc  # noqa: E402
from tpu_ckpt.settings import configure, settings  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from rss import reset_peak, rss  # noqa: E402  (tests/support/rss.py)

ASYNC = tc.CheckpointOptions(enable_async=True)


directory, megabytes, reuse = sys.argv[1], int(sys.argv[2]), sys.argv[3] != "no-reuse"
configure(dataclasses.replace(settings(), reuse_snapshot_buffers=reuse))
mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
n = megabytes * (1 << 20) // 4
x = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32).reshape(-1, 1024), out_shardings=NamedSharding(mesh, P("data")))()
x.block_until_ready()
tc.save(os.path.join(directory, "warmup"), {"x": jnp.ones(8)}, options=ASYNC).wait()
out = {"state_bytes": n * 4}
for name in ("first", "second"):
    reset_peak(trim=True)
    base = rss("VmRSS")
    result = tc.save(os.path.join(directory, name), {"x": x}, options=ASYNC)
    returned = rss("VmRSS") - base
    result.wait()
    out[name] = {"returned": returned, "peak": rss("VmHWM") - base, "after": rss("VmRSS") - base}
target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)}
restored = tc.restore(os.path.join(directory, "second"), target)
out["second_restores_exactly"] = bool((restored["x"] == x).all())
print(json.dumps(out))
