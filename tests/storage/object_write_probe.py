"""Peak host memory of one sync save to an object store, in a fresh process (for
test_object_writes); then a restore, checked bit for bit.

Arguments: the checkpoint URL, the state's size in MiB, the ``object_bytes`` setting, and
optionally a ``host_memory_limit`` for the save. The
emulator's endpoint and credentials come from the environment the test set. Prints one JSON
line: the state's bytes, the save's peak RSS above the RSS before it, whether the restore
was exact.
"""

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpu_ckpt as tc  # noqa: E402
from tpu_ckpt.settings import configure, settings  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from rss import reset_peak, rss  # noqa: E402  (tests/support/rss.py)

url, megabytes, object_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
options = tc.CheckpointOptions(host_memory_limit=int(sys.argv[4]) if len(sys.argv) > 4 else None)
configure(dataclasses.replace(settings(), object_bytes=object_bytes))
mesh = jax.make_mesh((4, 2), ("data", "model"))
# Two kinds of leaves: blocks on every device, and blocks split on "data" only, replicated
# on "model", whose pieces (a quarter of the leaf each) are bigger than an object.
specs = [P("data", "model"), P("data"), P("data", "model"), P("data")]
n = megabytes * (1 << 20) // 4 // len(specs)


def leaf(i: int, spec: P) -> jax.Array:
    def make() -> jax.Array:  # float32 of scattered bit patterns, NaNs included
        bits = (jnp.arange(n, dtype=jnp.uint32) * np.uint32(2654435761) + np.uint32(i)).reshape(-1, 1024)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    return jax.jit(make, out_shardings=NamedSharding(mesh, spec))()


state = {f"w{i}": leaf(i, spec) for i, spec in enumerate(specs)}
jax.block_until_ready(state)
tc.save(url + "-warmup", {"x": jnp.ones(8)})  # tensorstore's context, threads and connections
reset_peak(trim=True)
base = rss("VmRSS")
tc.save(url, state, options=options)
save_peak = rss("VmHWM") - base
target = {key: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for key, x in state.items()}
restored = tc.restore(url, target)
exact = all(
    np.array_equal(np.asarray(restored[k]).view(np.uint32), np.asarray(x).view(np.uint32)) for k, x in state.items()
)
print(json.dumps({"state_bytes": n * 4 * len(specs), "save_peak": save_peak, "exact": exact}))
