"""Issue #35's row for benchmarks/benchmark.py: what resuming exactly costs a save of the lm
workload. The same state is saved with what a training loop adds to resume exactly, typed
PRNG keys (one per device, sharded) and a 1 MiB ``tc.PerProcess`` value (a data iterator's
state), and without them; target: <= 1.02x the time.

Per rep, each save from an empty page cache (where the process may drop it), the two in
turns (the order swapped every rep); the ratio is the median of the per-rep ratios. Run
alone (8 CPU devices): ``python benchmarks/per_process_rows.py [--scale 0.1] [--reps 5]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc

TARGET = 1.02
VALUE_BYTES = 1 << 20


def resume_extras() -> dict:
    """What a loop saves besides its state to resume exactly: a PRNG key per device, sharded,
    and this process's data-iterator state."""
    devices = jax.devices()
    keys = jax.random.split(jax.random.key(0), len(devices))
    keys = jax.device_put(keys, NamedSharding(Mesh(np.array(devices), ("d",)), P("d")))
    return {"rng": keys, "data": tc.PerProcess({"iterator": np.random.default_rng(0).bytes(VALUE_BYTES), "epoch": 3})}


def _timed_save(path: str, tree: Any, drop: Callable[[], Any]) -> float:
    drop()
    started = time.perf_counter()
    tc.save(path, tree).wait()
    elapsed = time.perf_counter() - started
    shutil.rmtree(path)
    return elapsed


def per_process_rows(state: Any, workdir: str, reps: int, drop: Callable[[], Any]) -> list[dict]:
    """A warm-up of each, then ``reps`` measured pairs; prints the row and returns it."""
    plain, extended = {"state": state}, {"state": state, **resume_extras()}
    path = os.path.join(workdir, "per_process_rows")
    for tree in (plain, extended):  # warm-up
        _timed_save(path, tree, drop)
    pairs = []
    for rep in range(reps):
        if rep % 2:
            with_extras = _timed_save(path, extended, drop)
            without = _timed_save(path, plain, drop)
        else:
            without = _timed_save(path, plain, drop)
            with_extras = _timed_save(path, extended, drop)
        pairs.append((with_extras, without))
    ratio = statistics.median(a / b for a, b in pairs)
    row = {"metric": "lm save + typed keys + 1 MiB tc.PerProcess (s)",
           "tpu_ckpt": f"{statistics.median(a for a, _ in pairs):.3f}",
           "baseline": f"without {statistics.median(b for _, b in pairs):.3f}", "ratio": f"{ratio:.3f}x",
           "target": f"<= {TARGET}x", "result": "PASS" if ratio <= TARGET else "FAIL"}
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 1e6
    print(f"\n== workload lm ({size:.0f} MB): resuming exactly, keys and a per-process value "
          "(medians of per-rep ratios) ==")
    print("  ".join(f"{row[c]:>16}" if i else f"{row[c]:48}" for i, c in enumerate(row)))
    return [row]


def main() -> None:
    import argparse
    import tempfile

    import benchmark  # benchmarks/: asks for 8 CPU devices before JAX starts them

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.1, help="lm size; 1.0 ~= 1.3 GB with Adam's state")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="tpu_ckpt_per_process_")
    try:
        per_process_rows(benchmark.lm_state(args.scale), workdir, args.reps, benchmark.drop_caches)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
