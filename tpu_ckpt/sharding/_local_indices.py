"""Which block of a leaf each of this process's devices holds, worked out from those devices
alone (a restore's plan, ``restoring/_plan.py``).

JAX's ``addressable_devices_indices_map`` builds the map of every device of the job and
keeps this process's entries: per leaf layout O(global devices), 6,144 entries at 1,536
hosts of 4 chips where this process has 4, and a restore of a model's leaves of many
shapes pays it per shape. For a :class:`NamedSharding` a device's block follows from its
place in the mesh (this process's places found in one pass over the mesh, once per mesh),
so each layout costs O(local devices). Other shardings, and specs this does not read
(unreduced axes, an unconstrained dimension, a dimension the mesh does not divide), go
through JAX.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

Index = tuple[slice, ...]


def local_indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> Mapping[Any, Index | None]:
    """This process's devices and the block of a leaf of ``shape`` each holds, as
    ``sharding.addressable_devices_indices_map(shape)`` gives them."""
    axes = _spec_axes(sharding, shape)
    if axes is None or not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return sharding.addressable_devices_indices_map(shape)
    return block_indices(sharding.mesh, axes, shape, _local_places(sharding.mesh))


def block_indices(
    mesh: Mesh, axes: Sequence[tuple[str, ...]], shape: tuple[int, ...], places: Mapping[Any, tuple[int, ...]]
) -> dict[Any, Index]:
    """The block each device of ``places`` (device -> its place in ``mesh``) holds of a leaf
    of ``shape`` split along ``axes`` (per dimension, the mesh axes that split it, major first)."""
    sizes = dict(mesh.shape)
    position = {name: n for n, name in enumerate(mesh.axis_names)}
    out = {}
    for device, place in places.items():
        index = []
        for dim, names in zip(shape, axes):
            if not names:
                index.append(slice(None))
                continue
            block, count = 0, 1
            for name in names:
                block, count = block * sizes[name] + place[position[name]], count * sizes[name]
            index.append(slice(block * (dim // count), (block + 1) * (dim // count)))
        out[device] = tuple(index)
    return out


def _spec_axes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[tuple[str, ...]] | None:
    """Per dimension, the mesh axes that split it; None where this module does not read the
    sharding (then JAX does)."""
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return None
    if getattr(sharding.spec, "unreduced", None) or len(sharding.spec) > len(shape):
        return None
    sizes = dict(sharding.mesh.shape)
    axes = []
    for dim, entry in zip(shape, (*sharding.spec, *(None,) * (len(shape) - len(sharding.spec)))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if not isinstance(names, tuple) or not all(isinstance(n, str) and n in sizes for n in names):
            return None  # PartitionSpec.UNCONSTRAINED and the like
        if dim % int(np.prod([sizes[n] for n in names], dtype=np.int64)):
            return None
        axes.append(names)
    return axes


@functools.lru_cache(maxsize=64)
def _local_places(mesh: Mesh) -> dict[Any, tuple[int, ...]]:
    """This process's devices and their places in ``mesh``: one pass over it, once per mesh."""
    me = jax.process_index()
    return {d: tuple(int(i) for i in place) for place, d in np.ndenumerate(mesh.devices) if d.process_index == me}
