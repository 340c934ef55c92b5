"""A Hugging Face export written by every process of a job, then loaded back onto a mesh
whose devices are reversed, run by every process (see tests/support/process_group.py)."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.mp_scenarios import _bytes_written, _global_array, _job_mesh, _reversed_mesh, _shard_mismatches

# four 1 MiB tensors, one per file at a max_shard_size of 1 MiB: two files for each of 2 processes, one for each of 4
VALUES = {f"w{i}": np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024) * (i + 1) for i in range(4)}


def export_from_every_process(directory: str) -> dict:
    mesh, train, hf = _job_mesh(), os.path.join(directory, "train"), os.path.join(directory, "hf")
    params = {key: _global_array(mesh, P("data", "model"), value) for key, value in VALUES.items()}
    tc.save(train, {"params": params}).wait()
    before = _bytes_written()
    tc.export_for_serving(train, hf, layout="huggingface", max_shard_size=1 << 20)
    written = _bytes_written() - before
    other = _reversed_mesh()
    target = {key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, P("model", "data")))
              for key, v in VALUES.items()}
    before = _bytes_read()
    loaded = tc.load_safetensors(hf, target)
    read = _bytes_read() - before
    mismatches = [m for key, value in VALUES.items() for m in _shard_mismatches(loaded[key], value, key)]
    held = sum(_held(array) for array in loaded.values())
    return {"written": written, "read": read, "held": held, "files": sorted(os.listdir(hf)), "mismatches": mismatches}


def _bytes_read() -> int:
    """Bytes this process read with read system calls, from any file (``rchar``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _held(array: jax.Array) -> int:
    """The distinct bytes of ``array`` this process's devices hold (a replica counted once)."""
    slices = {tuple(s.indices(n)[:2] for s, n in zip(shard.index, array.shape)) for shard in array.addressable_shards}
    return sum(int(np.prod([b - a for a, b in s])) for s in slices) * array.dtype.itemsize
