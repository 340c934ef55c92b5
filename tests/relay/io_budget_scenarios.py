"""io_device at scale, in real processes (tests/relay/test_io_budget.py): a save and a restore
through the io process at a configured rate too slow for coordination_timeout."""

from __future__ import annotations

import logging
import os

import jax
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.mp_scenarios import GLOBAL, _global_array, _job_mesh, _mismatches, _targets
from tpu_ckpt.settings import Settings, configure


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def slow_io_device(directory: str, io: str) -> dict:
    """Saves and restores a small state with io_device at 1 byte a second: both operations'
    estimates exceed the 60 s timeout; the warnings this process logs, and what it restored."""
    configure(Settings(io_device_bytes_per_second=1.0))
    kept = _Kept()
    logging.getLogger("tpu_ckpt").addHandler(kept)
    mesh = _job_mesh()
    tree = {"w": _global_array(mesh, P("data", "model")), "b": _global_array(mesh, P()), "step": 7}
    options = tc.CheckpointOptions(io_device=int(io), coordination_timeout=60)
    path = os.path.join(directory, "ckpt")
    tc.save(path, tree, options=options)
    restored = tc.restore(path, _targets(tree, mesh), options=options)
    logging.getLogger("tpu_ckpt").removeHandler(kept)
    budget = [m for m in kept.messages if "through the io_device process" in m]
    return {"process": jax.process_index(), "warnings": budget, "job_bytes": 2 * GLOBAL.nbytes,
            "mismatches": _mismatches(restored, {"w": GLOBAL, "b": GLOBAL, "step": 7})}
