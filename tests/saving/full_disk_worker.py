"""Saves where a file cannot be written whole, for test_save_integrity (run as a script).

    python full_disk_worker.py tmpfs|fsize DIRECTORY

A trial save to DIRECTORY/trial measures the tree's one data file and its manifest (larger,
by its long key paths). Then each case saves the tree into a fresh DIRECTORY/<case> where
either the data file or the manifest does not fit:

- ``tmpfs``: a tmpfs mounted on the case's directory, exactly as many pages as the data
  file fills (the manifest then finds no room: ENOSPC) or one page fewer (the data file does
  not fit). Run this under ``unshare -m``: the mounts are private and vanish with the process.
- ``fsize``: ``RLIMIT_FSIZE`` at the data file's size (the larger manifest fails with EFBIG)
  or half of it, SIGXFSZ ignored so that the write fails instead of the process.

Synchronous saves raise from ``save``; asynchronous ones from the next ``save`` (the
background failure nobody has waited on). Each case prints one JSON line: the error's
class names, message and ``file``, and what is left in the case's directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import tpu_ckpt as tc  # noqa: E402

DATA_FILE = "d00000-00000.safetensors"
PAGE = 4096
TREE = {
    "encoder": {
        f"block_{i}": {"self_attention": {"query_projection": {"kernel": np.full((4,), i, np.float32)}}}
        for i in range(64)
    },
    "step": 3,
}


@contextlib.contextmanager
def room(mechanism: str, where: str, data_size: int, too_small_for: str) -> Iterator[None]:
    """Makes ``too_small_for`` ("data" or "manifest") unwritable in ``where``."""
    if mechanism == "tmpfs":
        pages = -(-data_size // PAGE) + 1 - (too_small_for == "data")  # + the staging marker's page
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", where], check=True)
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (data_size if too_small_for == "manifest" else data_size // 2, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def attempt(path: str, mode: str, next_path: str) -> Exception | None:
    try:
        if mode == "sync":
            tc.save(path, TREE)
        else:
            tc.save(path, TREE, options=tc.CheckpointOptions(enable_async=True))
            tc.save(next_path, TREE)  # raises the background failure first
    except Exception as error:  # noqa: BLE001 - reported to the test
        return error
    return None


def main(mechanism: str, root: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    trial = os.path.join(root, "trial", "c")
    tc.save(trial, TREE)
    data_size = os.path.getsize(os.path.join(trial, DATA_FILE))
    if os.path.getsize(os.path.join(trial, "manifest.json")) <= data_size:
        sys.exit("the manifest must be larger than the data file for the fsize cases")
    for too_small_for in ("data", "manifest"):
        for mode in ("sync", "async"):
            case = f"{too_small_for}-{mode}"
            where = os.path.join(root, case)
            os.makedirs(where)
            with room(mechanism, where, data_size, too_small_for):
                error = attempt(os.path.join(where, "c"), mode, os.path.join(root, f"next-{case}"))
                left = sorted(os.listdir(where))
            print(json.dumps({
                "case": case,
                "types": [c.__name__ for c in type(error).__mro__] if error else None,
                "message": str(error),
                "file": getattr(error, "file", None),
                "left": left,
            }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
