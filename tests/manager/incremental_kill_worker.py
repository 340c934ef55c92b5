"""A training loop for test_incremental.py to SIGKILL (run as a script).

    python incremental_kill_worker.py DIRECTORY

Saves steps with ``CheckpointManager(incremental=True, max_to_keep=2)`` from the step after
the latest committed one, forever: a frozen base (a jax.Array and a numpy array, the same
objects every step) and a small trained part that changes every step (``trained(step)``).
Prints ``SAVED <step>`` (flushed) after each save, so the test knows a kill can land in a
save or in its retention.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

ROWS = 1024


def frozen() -> dict:
    return {
        "np": np.arange(ROWS * 512, dtype=np.float32).reshape(ROWS, 512), "jax": np.full((ROWS, 256), 3.0, np.float32)
    }


def trained(step: int) -> dict:
    return {"a": np.full((64, 16), step, np.float32), "count": np.int64(step)}


def main(directory: str) -> None:
    import jax.numpy as jnp

    import tpu_ckpt as tc

    base = frozen()
    base["jax"] = jnp.asarray(base["jax"])
    with tc.CheckpointManager(directory, max_to_keep=2, incremental=True) as manager:
        step = (manager.latest_step() or 0) + 1
        while True:
            manager.save(step, {"base": base, "trained": trained(step)})
            print(f"SAVED {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main(sys.argv[1])
