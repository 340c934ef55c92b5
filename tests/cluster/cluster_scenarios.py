"""Scenarios of the coordinator alone, run by tests/support/mp_worker.py in each process."""

from __future__ import annotations

import time

from tpu_ckpt import cluster
from tpu_ckpt.errors import CoordinationTimeoutError


def busy_leader(steps: str, stall: str, timeout: str = "2.5") -> dict:
    """Process 0 works ``steps`` beats of ``timeout`` / 2.5 seconds (a second at the default
    timeout), reporting progress after each, then stalls ``stall`` seconds without a word
    before it publishes; the others wait for it with ``timeout``."""
    with cluster.Coordinator("busy leader", timeout=float(timeout)) as coord:
        started = time.monotonic()
        if coord.me == 0:
            for done in range(int(steps)):
                time.sleep(float(timeout) / 2.5)
                coord.progress(f"merging indexes ({done + 1} of {steps})")
            time.sleep(float(stall))
            coord.publish("committed")
            return {"error": None}
        try:
            coord.receive("committed", 0)
        except CoordinationTimeoutError as error:
            return {"error": type(error).__name__, "message": str(error), "waited": time.monotonic() - started}
        return {"error": None, "waited": time.monotonic() - started}
