"""Measures the peak host memory of a Hugging Face export and of load_safetensors of one
leaf much bigger than ``host_memory_limit``, in a fresh process (for
tests/interop/test_huggingface.py).

Prints one JSON line: the leaf's bytes and, for each direction, the peak RSS above the RSS
before it (tests/support/rss.py); the export with a transpose, the load onto a sharded target (each
device's slice assembled on the host once, so the load's peak counts one slice, not the leaf).
The leaf is freed once saved and checked shard by shard, so that the probe itself holds one
copy of it at most: ``python tests/interop/hf_memory_probe.py DIR MEGABYTES LIMIT_BYTES``.
"""

import json
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from rss import measured  # noqa: E402  (tests/support/rss.py)

directory, megabytes, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = megabytes * (1 << 20) // 4 // 1024  # an int32 leaf of (rows, 1024): exact values at any size
tc.save(os.path.join(directory, "train"), {"params": {"w": np.arange(rows * 1024, dtype=np.int32).reshape(rows, 1024)}})
bounded = tc.CheckpointOptions(host_memory_limit=limit)
names = {"params/w": {"name": "w", "transpose": True}}
hf = os.path.join(directory, "hf")
out = {"leaf_bytes": rows * 1024 * 4}
measured(out, "export", lambda: tc.export_for_serving(
    os.path.join(directory, "train"), hf, layout="huggingface", names=names, options=bounded
))
mesh = jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])
target = {"w": jax.ShapeDtypeStruct((1024, rows), np.int32, sharding=NamedSharding(mesh, P("x")))}
loaded = measured(out, "load", lambda: tc.load_safetensors(hf, target, options=bounded))


def exact(shard: jax.Shard) -> bool:
    """The shard holds its part of the source transposed: element [i, j] is j * 1024 + i."""
    (i0, i1), (j0, j1) = (s.indices(n)[:2] for s, n in zip(shard.index, (1024, rows)))
    want = np.arange(j0, j1, dtype=np.int32)[None, :] * 1024 + np.arange(i0, i1, dtype=np.int32)[:, None]
    return bool(np.array_equal(np.asarray(shard.data), want))


out["exact"] = all(exact(shard) for shard in loaded["w"].addressable_shards)
print(json.dumps(out))
