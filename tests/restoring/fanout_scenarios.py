"""The collective's replica axes inside slice copies (restoring/_fanout.py), decided in real
processes (run by tests/support/process_group.py): 4 processes of 2 devices on a (2, 4) mesh
("slice", "model"), row 0 holding processes 0-1's devices and row 1 processes 2-3's."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_ckpt.restoring import _fanout


def axes_inside_copies(directory: str) -> dict:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("slice", "model"))
    by_slice = (frozenset({0, 1}), frozenset({2, 3}))
    across = (frozenset({0, 2}), frozenset({1, 3}))  # each copy a column pair: a sum over "slice" misses half

    def axes(spec: P, copies: tuple[frozenset[int], ...], replica_axes=("slice", "model")) -> list[str]:
        return list(_fanout._inside_copies(NamedSharding(mesh, spec), (4, 8), replica_axes, copies))

    return {"replicated_by_slice": axes(P(), by_slice), "replicated_across": axes(P(), across),
            "sharded_by_slice": axes(P("model"), by_slice, ("slice",)),
            "two_in_one_copy": axes(P(), (frozenset(range(4)),))}
