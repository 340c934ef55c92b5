"""A process for test_crash_safety to SIGKILL while it saves (run as a script).

    python crash_worker.py DIRECTORY sync|async

Saves step 1 of a deterministic ~512 MB state synchronously into DIRECTORY/step_1, then
saves step 2 into DIRECTORY/step_2, announcing each moment on stdout (flushed), so the test
can kill it at a chosen one:

    SAVED1 <seconds>   step 1 committed; how long its synchronous save took
    SAVING             step 2's save() is about to be called
    RETURNED           (async) step 2's save() returned: the data is on the host
    DONE               step 2 is committed (its save returned, or wait() did)

Also imported by the test for ``arrays(step)``, the expected contents of each step.
"""

from __future__ import annotations

import os
import sys
import time

# Eight CPU devices for the sharded leaf; has no effect once jax is initialised (pytest).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

LEAVES = 8
ROWS, COLS = 4096, 4096  # float32: 64 MiB per leaf, 512 MiB per step
SHARDED_LEAF = "layer_0"  # saved as a jax.Array split over 8 CPU devices; the rest are numpy


def _base() -> np.ndarray:
    """A position-dependent bit pattern: float32 values in [1, 2) with scrambled mantissas,
    so a piece written to the wrong place or offset cannot compare equal by accident."""
    x = np.arange(ROWS * COLS, dtype=np.uint32)
    x *= np.uint32(2654435761)  # Knuth's multiplicative hash
    x >>= np.uint32(9)
    x |= np.uint32(0x3F800000)
    return x


def arrays(step: int):
    """Yields (name, float32 array) for every leaf of ``step``: cheap to make (one XOR of a
    shared pattern per leaf) and different in every leaf and every step."""
    base = _base()
    for i in range(LEAVES):
        salt = (step * 1_000_003 + i * 7_919 + 1) * 2654435761 & 0x007FFFFF or 1  # mantissa bits only
        yield f"layer_{i}", (base ^ np.uint32(salt)).view(np.float32).reshape(ROWS, COLS)


def tree(step: int) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), PartitionSpec("x"))
    out = {"step": step, "params": {}}
    for name, value in arrays(step):
        out["params"][name] = jax.device_put(value, sharding) if name == SHARDED_LEAF else value
    jax.block_until_ready(out)
    return out


def say(*words) -> None:
    print(*words, flush=True)


def main() -> None:
    import tpu_ckpt as tc

    directory, mode = sys.argv[1], sys.argv[2]
    options = tc.CheckpointOptions(enable_async=mode == "async")
    state = tree(1)
    started = time.perf_counter()
    tc.save(os.path.join(directory, "step_1"), state).wait()
    say("SAVED1", f"{time.perf_counter() - started:.3f}")
    del state
    state = tree(2)
    say("SAVING")
    result = tc.save(os.path.join(directory, "step_2"), state, options=options)
    if mode == "async":
        say("RETURNED")
    result.wait()
    say("DONE")


if __name__ == "__main__":
    main()
