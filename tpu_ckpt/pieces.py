"""Pieces: the unit a sharding callback arranges into data files.

A piece is one distinct block of one array leaf that this process must write: each
addressable shard of a ``jax.Array`` whose ``replica_id`` is 0 (so replicas are written
once across the whole job), or a whole numpy array (written by process 0 only, since every
process of an SPMD program holds the same host value).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

SliceSpec = tuple[tuple[int, int], ...]
"""Where a piece sits in its global array: one ``(start, stop)`` pair per dimension."""

Shard = dict[str, dict[SliceSpec, Any]]
"""One data file: ``{checkpoint_key: {slice_spec: array}}``."""


@dataclasses.dataclass(frozen=True)
class ShardableTensor:
    """One piece of one leaf, as handed to a :class:`ShardingCallback`.

    Attributes:
      tensor: the piece's data (a numpy array, or a single-device ``jax.Array`` off-CPU so
        that device-to-host copies happen one data file at a time).
      checkpoint_key: the leaf's key path joined by ``/``.
      slice_spec: the piece's ``(start, stop)`` bounds in the global array; ``()`` for a scalar.
      shape: the global shape of the leaf.
      dtype: the leaf's numpy dtype.
      device: the device holding the piece (``None`` for host values).
      is_slot: whether the leaf is optimizer slot state (recorded in the manifest).
    """

    tensor: Any = dataclasses.field(compare=False, repr=False)
    checkpoint_key: str
    slice_spec: SliceSpec
    shape: tuple[int, ...]
    dtype: np.dtype
    device: Any = dataclasses.field(default=None, compare=False)
    is_slot: bool = False

    @property
    def slice_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.slice_spec)

    @property
    def nbytes(self) -> int:
        return math.prod(self.slice_shape) * np.dtype(self.dtype).itemsize


class ShardingCallback(abc.ABC):
    """Decides which pieces go into which data file.

    Subclasses implement ``description`` and ``__call__(shardable_tensors)``, returning a list
    of shards ``{checkpoint_key: {slice_spec: array}}``; each shard becomes one data file.
    A callback may cut pieces into smaller blocks (slicing ``tensor``) but must cover every
    piece exactly once without changing dtypes; the result is validated before any byte is
    written. It is called once per process with that process's pieces.
    """

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """A human-readable summary, recorded in the manifest and used in error messages."""

    @abc.abstractmethod
    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> list[Shard]:
        """Returns the shards (data files) for this process's pieces."""

    def __hash__(self) -> int:
        # Like TF: equal descriptions and configuration hash equal.
        h = hash(self.description)
        for name, value in vars(self).items():
            if not callable(value):
                h ^= hash(name)
                try:
                    h ^= hash(value)
                except TypeError:
                    pass
        return h

    def __eq__(self, other: object) -> bool:
        return self is other


def full_slice(shape: Sequence[int]) -> SliceSpec:
    return tuple((0, int(d)) for d in shape)


def index_to_slice(index: tuple[slice, ...], shape: Sequence[int]) -> SliceSpec:
    """Converts a shard's ``index`` (tuple of slices) into ``(start, stop)`` pairs."""
    out = []
    for s, dim in zip(index, shape):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        out.append((start, stop))
    return tuple(out)


SPLIT_REPLICAS_FROM = 4 << 20
"""A block held by several processes and at least this big is split between them, so that
replicated state does not all land on one host's write bandwidth."""


def array_pieces(key: str, leaf: Any, *, process_index: int, is_slot: bool = False) -> list[ShardableTensor]:
    """The pieces of one array leaf that the calling process must write.

    Each distinct block of the array is written once in the whole job: by the device holding
    replica 0, or, when several processes hold a big block (``SPLIT_REPLICAS_FROM``), split
    into one part per holding process, each written by that process.
    """
    if not isinstance(leaf, jax.Array):
        array = np.asarray(leaf)
        if process_index != 0:
            return []
        shape = tuple(array.shape)
        return [ShardableTensor(array, key, full_slice(shape), shape, array.dtype, None, is_slot)]
    shape = tuple(leaf.shape)
    dtype = np.dtype(leaf.dtype)
    holders = {} if leaf.is_fully_addressable else _holding_processes(leaf)
    pieces, split_done = [], set()
    for shard in leaf.addressable_shards:
        region = index_to_slice(shard.index, shape)
        writers = holders.get(region, [])
        part = _my_part(region, writers, process_index, dtype.itemsize)
        if part is None:
            if shard.replica_id != 0:
                continue
            part = region
        elif region in split_done:
            continue
        else:
            split_done.add(region)
        data = shard.data
        tensor = np.asarray(data) if shard.device.platform == "cpu" else data
        if part != region:
            tensor = tensor[tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(part, region))]
        pieces.append(ShardableTensor(tensor, key, part, shape, dtype, shard.device, is_slot))
    return pieces


def _holding_processes(leaf: jax.Array) -> dict[SliceSpec, list[int]]:
    """For each block of a multi-process array, the processes holding it, in order."""
    holders: dict[SliceSpec, list[int]] = {}
    for device, index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).items():
        processes = holders.setdefault(index_to_slice(index, leaf.shape), [])
        if device.process_index not in processes:
            processes.append(device.process_index)
    return {region: sorted(processes) for region, processes in holders.items()}


def _my_part(region: SliceSpec, writers: list[int], me: int, itemsize: int) -> SliceSpec | None:
    """This process's share of a block several processes hold, or None when it is not split."""
    extents = [b - a for a, b in region]
    if len(writers) < 2 or math.prod(extents) * itemsize < SPLIT_REPLICAS_FROM:
        return None
    axis = next((i for i, n in enumerate(extents) if n >= len(writers)), None)
    if axis is None:
        return None
    k, n = writers.index(me), len(writers)
    start, extent = region[axis][0], extents[axis]
    cut = (start + extent * k // n, start + extent * (k + 1) // n)
    return region[:axis] + (cut,) + region[axis + 1 :]


def describe_sharding(leaf: Any) -> dict[str, Any] | None:
    """A JSON description of how a leaf was sharded when saved (informational only)."""
    if not isinstance(leaf, jax.Array):
        return None
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        return {"type": "NamedSharding", "mesh": dict(sharding.mesh.shape), "spec": spec}
    return {"type": type(sharding).__name__, "num_devices": len(sharding.device_set)}
