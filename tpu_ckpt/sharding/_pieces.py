"""Pieces: the unit a sharding callback arranges into data files.

A piece is one distinct block of one array leaf that this process must write. Every block is written once across the
whole job: a block one process holds is written by it; a block several processes hold (a replicated array) is written by
the holder with the least of such blocks of the same holders to write so far, or, when big, split into one part per
holder (:class:`WriteBalance`): decided from this process's own blocks alone. A numpy leaf is written whole by process
0, since every process of an SPMD program holds the same host value.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from tpu_ckpt.format import PlannedPiece, SliceSpec, full_slice, volume

Shard = dict[str, dict[SliceSpec, Any]]
"""One data file: ``{checkpoint_key: {slice_spec: array}}``."""
T = TypeVar("T")


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
        """The piece's own shape (``stop - start`` along each axis)."""
        return tuple(stop - start for start, stop in self.slice_spec)

    @property
    def nbytes(self) -> int:
        """The piece's bytes of element data."""
        return math.prod(self.slice_shape) * np.dtype(self.dtype).itemsize


class ShardingCallback(abc.ABC):
    """Decides which pieces go into which data file.

    Subclasses implement ``description`` and ``__call__(shardable_tensors)``, returning a list of shards
    ``{checkpoint_key: {slice_spec: array}}``; each shard becomes one data file. A callback may cut pieces into smaller
    blocks (slicing ``tensor``) but must cover every piece exactly once without changing dtypes; the result is validated
    before any byte is written. It is called once per process with that process's pieces.
    """

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """A human-readable summary, recorded in the manifest and used in error messages."""

    @abc.abstractmethod
    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> list[Shard]:
        """The shards (data files) for this process's pieces.

        Args:
          shardable_tensors: every piece this process saves, in the save's order.

        Returns:
          A list of shards ``{checkpoint_key: {slice_spec: array}}``, one per data file.
          A result that does not cover each piece exactly once, or changes a dtype, makes
          ``save`` raise :class:`InvalidShardsError` before any byte is written.
        """

    def arrangement(self, pieces: Sequence[T], devices: Sequence[Any]) -> list[list[T]] | None:
        """The data files this callback makes, as groups of ``pieces`` (``devices``: each one's device, None for a host
        value), where it can tell them without ``ShardableTensor``s: a save of a million pieces then makes no object per
        piece. None (this default): the save calls the callback and checks what it returns."""
        return None

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


class WriteBalance:
    """Decides which process writes each block several processes hold, so that no host
    writes much more than its share (replicated state otherwise all lands on one host).

    Every process walks the same leaves in the same order and sees the same global shardings, so each makes the same
    choices without any communication: a held block goes to the holder with the fewest bytes assigned so far (lowest
    index on ties). A save keeps one per set of holders, updated only by the blocks of exactly those holders, which each
    of them holds (``_my_blocks``).
    """

    def __init__(self) -> None:
        self.load: collections.Counter[int] = collections.Counter()

    def assign(self, holders: list[int], nbytes: int) -> int:
        chosen = min(holders, key=lambda p: (self.load[p], p))
        self.load[chosen] += nbytes
        return chosen


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where every array of one sharding and shape keeps its blocks, worked out once per save from the first such leaf:
    jax builds a ``Shard`` object per device for each array's ``addressable_shards`` (~10 µs each, seconds at 2,200
    leaves over 512 devices), where ``addressable_data(position)`` of a later leaf costs a tenth of that."""

    spans_processes: bool
    # (position, device, block, on CPU, elements), a holder each
    local_blocks: tuple[tuple[int, Any, SliceSpec, bool, int], ...]
    # local blocks other processes hold too, sorted, and their holders
    shared: tuple[tuple[SliceSpec, tuple[int, ...]], ...]

    @property
    def on_cpu(self) -> bool:
        return all(on_cpu for _, _, _, on_cpu, _ in self.local_blocks)

    @staticmethod
    def of(leaf: jax.Array) -> _Layout:
        shape = tuple(leaf.shape)
        everywhere: set[jax.Device] = leaf.sharding.device_set  # jax.Device: jaxlib's own type has no stubs
        spans = len({d.process_index for d in everywhere}) > 1
        blocks: dict[SliceSpec, tuple[int, Any, SliceSpec, bool, int]] = {}
        for position, shard in enumerate(leaf.addressable_shards):
            region = index_to_slice(shard.index, shape)
            if region not in blocks and (spans or shard.replica_id == 0):  # else replica 0 is written
                blocks[region] = (position, shard.device, region, shard.device.platform == "cpu", volume(region))
        holders: dict[SliceSpec, set[int]] = {region: set() for region in blocks}
        if spans:  # once per layout, not per leaf: the one walk of every device
            device: jax.Device
            for device, index in leaf.sharding.devices_indices_map(shape).items():
                processes = holders.get(index_to_slice(index, shape))
                if processes is not None:
                    processes.add(device.process_index)
        shared = sorted((region, tuple(sorted(p))) for region, p in holders.items() if len(p) > 1)
        return _Layout(spans, tuple(blocks.values()), tuple(shared))




class LocalPieces:
    """The pieces of a tree this process writes, in leaf order, as planning carries them: a
    ``PlannedPiece`` each, and its device (``None`` for a host value) in a parallel list.

    ``ShardableTensor``s, which a sharding callback takes, are made from them only for a
    callback that needs them (``shardable``): the built-in device and task policies arrange
    these directly (``ShardByDevicePolicy.arrange``), since at a million pieces every object
    made per piece costs a second. A piece's data stays the device's own array, on CPU too,
    until its file is written: a numpy view of a CPU device buffer costs ~800 bytes, 3.5 GB
    for the 4.5 M pieces of one process simulating a pod. Also holds what a save's leaves
    share: the write balances (``WriteBalance``) and the layouts seen so far (``_Layout``).
    """

    def __init__(self, process_index: int, group: frozenset[int] | None = None):
        self.process_index = process_index
        # The processes that share the writing with this one (None: the job). A local tier
        # whose slices each hold the whole state writes a copy per slice (tiers/_slice_copies.py).
        self.group = group
        self.pieces: list[PlannedPiece] = []
        self.devices: list[Any] = []
        self._leaves: dict[str, tuple[tuple[int, ...], np.dtype, bool]] = {}  # shape, dtype, is_slot
        self._kinds: dict[tuple[tuple[int, ...], np.dtype, bool], tuple[tuple[int, ...], np.dtype, bool]] = {}
        self._balances: dict[tuple[int, ...], WriteBalance] = {}  # per set of holders (``_my_blocks``)
        self._layouts: dict[Any, _Layout] = {}
        self.on_device = False  # whether a piece is in an accelerator's memory (``data_writes.fetch_started``)

    def add(self, key: str, leaf: Any, *, is_slot: bool = False) -> None:
        """Adds the pieces of array leaf ``key`` that this process must write. Every process
        must add the same leaves in the same order: that is what keeps their write balance
        the same without talking."""
        if not isinstance(leaf, jax.Array):
            array = np.asarray(leaf)
            self._remember(key, tuple(array.shape), array.dtype, is_slot)
            if self.process_index == (0 if self.group is None else min(self.group)):
                self.pieces.append(PlannedPiece(key, full_slice(array.shape), array, array.nbytes))
                self.devices.append(None)
            return
        if leaf.is_deleted():  # else a layout seen before would let it through to the first write
            raise ValueError(f"Leaf {key!r} is a deleted jax.Array (donated to a jitted function?): save the arrays "
                             "the step returned, not those it was given")
        shape = tuple(leaf.shape)
        dtype = np.dtype(leaf.dtype)
        self._remember(key, shape, dtype, is_slot)
        layout = self._layouts.get((leaf.sharding, shape))
        if layout is None:
            layout = self._layouts[leaf.sharding, shape] = _Layout.of(leaf)
            self.on_device = self.on_device or not layout.on_cpu
        # Decided from the global sharding, the same on every process (hence the shared
        # balance); an array on one process's devices alone is that process's to write.
        mine = (
            _my_blocks(layout, dtype.itemsize, self.process_index, self._balances, self.group)
            if layout.shared else None
        )
        arrays, pieces, devices, itemsize = _device_arrays(leaf), self.pieces, self.devices, dtype.itemsize
        for position, device, region, on_cpu, elements in layout.local_blocks:
            part = region if mine is None else mine.get(region, region)
            if part is None:
                continue
            data: jax.Array | np.ndarray = arrays[position]
            if part is not region and part != region:  # a part of a big replicated block
                window = tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(part, region))
                data = (np.asarray(data) if on_cpu else data)[window]
                elements = volume(part)
            pieces.append(PlannedPiece(key, part, data, elements * itemsize))
            devices.append(device)

    def _remember(self, key: str, shape: tuple[int, ...], dtype: np.dtype, is_slot: bool) -> None:
        """Keeps a leaf's shape, dtype and slot flag for ``shardable``, one tuple per distinct
        three (a state may have a million leaves of a few kinds)."""
        kind = (shape, dtype, is_slot)
        self._leaves[key] = self._kinds.setdefault(kind, kind)

    def shardable(self) -> list[ShardableTensor]:
        """The pieces as a sharding callback takes them."""
        leaves = self._leaves
        return [
            ShardableTensor(host_view(p.data), p.key, p.slice, *leaves[p.key][:2], device, leaves[p.key][2])
            for p, device in zip(self.pieces, self.devices)
        ]


def on_cpu(data: Any) -> bool:
    """Whether ``data`` is a ``jax.Array`` on CPUs only (host memory; a fetch from a TPU or
    GPU is a copy of JAX's own)."""
    return isinstance(data, jax.Array) and all(device.platform == "cpu" for device in data.devices())


def on_one_cpu(data: Any) -> bool:
    """Whether ``data`` is a ``jax.Array`` on a single CPU device, whose buffer numpy views."""
    return on_cpu(data) and len(data.devices()) == 1


def host_view(data: Any) -> Any:
    """A CPU device's array as numpy (a view of its buffer, no copy), which a sharding
    callback can slice without JAX; anything else (a multi-device array a user's callback
    made, say) as it is."""
    return np.asarray(data) if on_one_cpu(data) else data


def planned(shard: Shard) -> list[PlannedPiece]:
    """A sharding callback's shard as the pieces of one data file, in writing order."""
    return [
        PlannedPiece(key, spec, data, int(data.nbytes))
        for key, by_slice in shard.items() for spec, data in by_slice.items()
    ]


def _device_arrays(leaf: jax.Array) -> Sequence[jax.Array]:
    """Each addressable shard's single-device array, in ``addressable_shards`` order. jax's internal ``_arrays`` gives
    them all at once, where the public ``addressable_data(i)`` rebuilds that list at every call (~1 µs each, a second
    per million pieces). A single-device array is its own: jax builds ``_arrays`` lazily for an array made by
    ``device_put``, ~2 KB of new objects per leaf that a save of many small leaves would hold."""
    if isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding):
        return (leaf,)
    arrays = getattr(leaf, "_arrays", None)
    if arrays is None:  # a jax without it
        return [leaf.addressable_data(i) for i in range(len(leaf.sharding.addressable_devices))]
    return arrays


def _my_blocks(
    layout: _Layout, itemsize: int, me: int, balances: dict[tuple[int, ...], WriteBalance],
    group: frozenset[int] | None = None,
) -> dict[SliceSpec, SliceSpec | None]:
    """For this process's blocks that other processes hold too: what it writes of each (the
    block, a part of it when big blocks are split between their holders, or None).

    Only this process's own blocks are walked, never the job's: a block's holders decide it
    with the balance of their own set of holders (``balances``), which each of them updates
    with the same blocks in the same order (every holder holds them all; leaves come in
    order, and a leaf's blocks sorted), so they agree without talking, and each host's
    planning follows its own share of the pieces, not the pod's."""
    mine: dict[SliceSpec, SliceSpec | None] = {}
    for region, holders in layout.shared:
        holders = holders if group is None else tuple(p for p in holders if p in group)
        balance = balances.get(holders)
        if balance is None:
            balance = balances[holders] = WriteBalance()
        parts = _split(region, holders, itemsize)
        if parts is None:
            mine[region] = region if balance.assign(list(holders), volume(region) * itemsize) == me else None
            continue
        for process, part in zip(holders, parts):
            balance.load[process] += volume(part) * itemsize
            if process == me:
                mine[region] = part
    return mine


def _split(region: SliceSpec, holders: Sequence[int], itemsize: int) -> list[SliceSpec] | None:
    """One part per holder of a big block, cut along its first axis long enough; None when
    the block stays whole (one holder, small, or no axis to cut)."""
    extents = [b - a for a, b in region]
    n = len(holders)
    if n < 2 or math.prod(extents) * itemsize < SPLIT_REPLICAS_FROM:
        return None
    axis = next((i for i, e in enumerate(extents) if e >= n), None)
    if axis is None:
        return None
    start, extent = region[axis][0], extents[axis]
    cuts = [(start + extent * k // n, start + extent * (k + 1) // n) for k in range(n)]
    return [region[:axis] + (cut,) + region[axis + 1 :] for cut in cuts]


def describe_sharding(leaf: Any) -> dict[str, Any] | None:
    """A JSON description of how a leaf was sharded when saved (informational only)."""
    if not isinstance(leaf, jax.Array):
        return None
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        described = {"type": "NamedSharding", "mesh": dict(sharding.mesh.shape), "spec": spec}
        types = [t.name for t in getattr(sharding.mesh, "axis_types", ())]
        return {**described, "axis_types": types} if any(t != "Auto" for t in types) else described
    return {"type": type(sharding).__name__, "num_devices": len(sharding.device_set)}
