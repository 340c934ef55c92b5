"""Measures peak host memory of a sync save, an async save and a restore of many small leaves
under ``host_memory_limit``, in a fresh process (for test_memory.py).

Prints one JSON line: for each operation the peak RSS above the RSS before it, and what it
still holds after it returned (the restored arrays, for the restore), in bytes.
"""

import json
import os
import sys

import jax
import numpy as np

import tpu_ckpt as tc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from rss import measured  # noqa: E402  (tests/support/rss.py)

directory, leaves, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tree = {f"l{i:06d}": jax.device_put(np.full(4096, i, np.float32)) for i in range(leaves)}  # 16 KiB each
jax.block_until_ready(tree)
bounded = tc.CheckpointOptions(host_memory_limit=limit)
tc.save(os.path.join(directory, "warmup"), {"x": np.ones(8)}, options=bounded.replace(enable_async=True)).wait()
out = {"state_bytes": leaves * 16384, "pieces": leaves}


measured(out, "sync_save", lambda: tc.save(os.path.join(directory, "sync"), tree, options=bounded))
measured(out, "async_save",
         lambda: tc.save(os.path.join(directory, "async"), tree, options=bounded.replace(enable_async=True)).wait())
target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
restored = measured(out, "restore", lambda: tc.restore(os.path.join(directory, "async"), target, options=bounded))
out["restored_exactly"] = all(np.array_equal(np.asarray(restored[k]), np.asarray(v)) for k, v in tree.items())
print(json.dumps(out))
