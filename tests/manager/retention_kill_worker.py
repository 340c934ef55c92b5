"""A restarted job for test_retention_references.py to SIGKILL at one deletion (run as a script).

    python retention_kill_worker.py DIRECTORY KILL_AT

Saves steps 5 and 6 of ``tree(step)`` with ``CheckpointManager(max_to_keep=2)`` (no
``incremental``: a restart that left the flag out) into a run that was saved incrementally,
and SIGKILLs itself at its ``KILL_AT``-th deletion call (a real store's ``delete`` or
``delete_all``, counted in order). Prints ``DONE <calls>`` if it made fewer calls.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402


def tree(step: int) -> dict:
    """The state of step ``step``: ``a`` never changes, ``b`` changes at step 3, ``t`` at every step."""
    return {
        "a": np.arange(4096, dtype=np.float32),
        "b": np.full(2048, 1.0 if step < 3 else 3.0, np.float32),
        "t": np.full(16, step, np.int32),
    }


def main(directory: str, kill_at: int) -> None:
    import tpu_ckpt as tc
    from tpu_ckpt import storage

    calls = [0]

    def counted(method):
        def deletion(self, *args):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return method(self, *args)

        return deletion

    local = type(storage.Store(storage.location(directory), threads=1))  # the local files' backend
    local.delete = counted(local.delete)
    local.delete_all = counted(local.delete_all)
    with tc.CheckpointManager(directory, max_to_keep=2) as manager:
        for step in (5, 6):
            manager.save(step, tree(step))
    print(f"DONE {calls[0]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
