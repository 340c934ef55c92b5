"""Measures the peak host memory of a Hugging Face export and of load_safetensors of one
leaf much bigger than ``host_memory_limit``, in a fresh process (for
tests/interop/test_huggingface.py).

Prints one JSON line: the leaf's bytes and, for each direction, the peak RSS above the RSS
before it (tests/rss.py); the export with a transpose, the load onto a sharded target (each
device's slice assembled on the host once, so the load's peak counts one slice, not the leaf).
"""

import json
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rss import measured  # tests/rss.py: this script's directory

import tpu_ckpt as tc

directory, megabytes, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = megabytes * (1 << 20) // 4 // 1024
tc.save(os.path.join(directory, "train"), {"params": {"w": np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)}})
bounded = tc.CheckpointOptions(host_memory_limit=limit)
names = {"params/w": {"name": "w", "transpose": True}}
hf = os.path.join(directory, "hf")
out = {"leaf_bytes": rows * 1024 * 4}
measured(out, "export", lambda: tc.export_for_serving(os.path.join(directory, "train"), hf, layout="huggingface", names=names, options=bounded))
mesh = jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])
target = {"w": jax.ShapeDtypeStruct((1024, rows), np.float32, sharding=NamedSharding(mesh, P("x")))}
loaded = measured(out, "load", lambda: tc.load_safetensors(hf, target, options=bounded))
w = np.asarray(loaded["w"])
out["exact"] = bool(np.array_equal(w, np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024).T))
print(json.dumps(out))
