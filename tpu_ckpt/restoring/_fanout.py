"""load_and_broadcast's data path: each replica reads a part, one XLA collective completes them all.

A target leaf on a ``NamedSharding`` over every process whose mesh has *replica axes* (axes
of size > 1 its PartitionSpec leaves out) across processes, with dimensions the mesh divides evenly
and a dtype of whole bytes (not complex), is restored here. The processes that hold each
distinct shard split its pieces between them, balanced by bytes over the whole restore
(``sharding.WriteBalance``: every process makes the same choices, without communicating), and
each reads only its own from storage: about 1/R of the bytes, R the processes holding the
shard. Each puts what it read, as unsigned integers of the item's width (at most 32 bits: a
64-bit item is two), on the first of its devices holding the shard
and zeros on the others, and one jitted ``psum`` over the replica axes (under ``shard_map``)
completes every replica. No byte is non-zero on more than one device, so the sum is the saved
bytes exactly (floats travel as their bytes: -0.0 and NaN payloads survive), then cast as the
target asks. On TPU the collective runs over ICI within a slice and DCN across slices; on CPU
over gloo.

The leaves go in batches, one collective per batch and mesh: a batch's shards add up, per
device, to at most the restore's read batch divided among the devices of a process
(``read_batch_bytes``: the setting, at most ``host_memory_limit / 4``). So beyond the restored
arrays a device holds at most two of those shares at once (the bytes in and the bytes out),
and a process's host at most one read batch.

Before each collective every process meets at a key-value barrier (the coordinator's, bounded
by ``coordination_timeout``): a process that failed or never arrives is named there, where a
hung collective would name nobody. Small numpy and Python targets go the same way
(:func:`_on_devices`). What is left (bigger host targets, other shardings, meshes over some
processes only, uneven dimensions, no replica across processes) goes the other ways of
``_shared_reads.py``. A tier restore where a slice lost its copy uses this path with only a
whole slice's processes reading (``split``'s ``readers``), host targets included.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Container, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_ckpt import cluster, storage
from tpu_ckpt.format import (
    PieceEntry,
    SliceSpec,
    byte_batches,
    dtype_from_name,
    extent,
    intersect,
    loaded_overlapping,
    relative,
)
from tpu_ckpt.restoring import _exec as restore_exec
from tpu_ckpt.restoring import _shared_reads as shared_reads
from tpu_ckpt.restoring._plan import ArrayRead, NoRead, RestorePlan, slice_devices
from tpu_ckpt.sharding import WriteBalance


@dataclasses.dataclass(frozen=True)
class FannedLeaf:
    """A target leaf the collective completes, and what this process reads of it."""

    position: int  # in RestorePlan.leaves
    array: ArrayRead
    axes: tuple[str, ...]  # the replica axes
    mine: dict[SliceSpec, tuple[PieceEntry, ...]]  # per local region: the pieces this process reads for it
    on_host: bool = False  # a numpy or Python target, carried on one device of each process (:func:`_on_devices`)

    @property
    def device_bytes(self) -> int:
        """The bytes of one device's shard (the same on every device: the mesh divides evenly)."""
        region = self.array.regions[0].slice
        return math.prod(extent(region)) * dtype_from_name(self.array.leaf.dtype).itemsize


def replica_axes(array: ArrayRead) -> tuple[str, ...]:
    """The mesh axes over which the collective completes ``array``'s target; () where it cannot
    (then the relay or plain reads do)."""
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding) or not _carried(array):
        return ()
    if sharding.memory_kind not in (None, "device") or not array.regions:
        return ()
    return _sharded_replica_axes(sharding, array.leaf.shape)


def _carried(array: ArrayRead) -> bool:
    """Whether the saved bytes travel as unsigned integers and come back as the target's dtype
    exactly: whole bytes, not complex, and nothing JAX without x64 would narrow."""
    saved = dtype_from_name(array.leaf.dtype)
    if saved.kind == "c" or jax.dtypes.itemsize_bits(saved) != 8 * saved.itemsize:
        return False
    return all(d.isnative and jax.dtypes.canonicalize_dtype(d) == d for d in (saved, array.dtype))


def _on_devices(array: ArrayRead, count: int, share: int, firsts: Callable[[], Firsts]) -> ArrayRead | None:
    """A numpy or Python target (every process wants it whole, on the host) as a leaf
    replicated over the first device of each process, which the collective completes like
    any other: a job's small host leaves (a step, a data iterator's arrays) travel packed in
    one collective, not as a relayed piece each. Only of at most ``share`` bytes (one device's
    part of a read batch: its device memory stays bounded) and a dtype the devices carry."""
    if array.sharding is not None or count < 2 or not _carried(array):
        return None
    if not 0 < math.prod(array.leaf.shape) * dtype_from_name(array.leaf.dtype).itemsize <= share:
        return None
    sharding, mine = firsts()
    (region,) = array.regions
    return dataclasses.replace(array, sharding=sharding, regions=(dataclasses.replace(region, devices=(mine,)),))


Firsts = tuple[NamedSharding, jax.Device]  # replicated over the first device of each process; this process's


def _first_devices() -> Firsts:
    first: dict[int, jax.Device] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):  # once a restore
        first.setdefault(device.process_index, device)
    return NamedSharding(Mesh(np.array(list(first.values())), ("processes",)), P()), first[jax.process_index()]


def _sharded_replica_axes(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[str, ...]:
    """:func:`replica_axes` as the sharding and shape alone decide them."""
    if not isinstance(sharding.mesh, Mesh):
        return ()
    mesh, spec = sharding.mesh, _padded(sharding.spec, len(shape))
    used = {name for part in spec for name in _names(part)}
    axes = tuple(name for name in mesh.axis_names if name not in used and mesh.shape[name] > 1)
    even = all(size % math.prod(mesh.shape[n] for n in _names(part)) == 0 for size, part in zip(shape, spec))
    return axes if axes and even and _across_processes(mesh, axes) else ()


def fanned_inside(copies: tuple[frozenset[int], ...]) -> Callable[[jax.sharding.Sharding, tuple[int, ...]], bool]:
    """Whether the collective may complete a target of a sharding and shape inside each of
    ``copies`` (:func:`split`): the leaves whose every shard's pieces a process plans with."""

    def fanned(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
        if not isinstance(sharding, NamedSharding):
            return False
        axes = _sharded_replica_axes(sharding, shape)
        return bool(axes) and bool(_inside_copies(sharding, shape, axes, copies))

    return fanned


def split(
    plan: RestorePlan, me: int, count: int, batch_bytes: int, readers: Container[int] | None = None,
    copies: Sequence[frozenset[int]] | None = None,
) -> tuple[list[FannedLeaf], RestorePlan]:
    """The leaves the collective completes (the same on every process; small host targets too:
    :func:`_on_devices`) and the plan of the rest. Each piece of a shard goes to one of the
    shard's processes, balanced by bytes; with ``readers``, only to those (a whole slice filling
    one that lost its copy; a leaf some shard of which none holds is left to the rest). With
    ``copies`` (each slice reading its own copy), each copy's processes read for it, and the
    collective runs over the replica axes inside a copy (:func:`_inside_copies`): no byte
    crosses slices."""
    balance = WriteBalance()
    fanned = []
    mine = next((copy for copy in copies if me in copy), frozenset()) if copies else readers
    share, firsts = _device_share(batch_bytes, count), functools.cache(_first_devices)
    for position, entry in enumerate(plan.leaves):
        host = _on_devices(entry, count, share, firsts) if isinstance(entry, ArrayRead) else None
        entry = host or entry
        axes = replica_axes(entry) if isinstance(entry, ArrayRead) else ()
        if axes and copies:
            assert isinstance(entry, ArrayRead)
            assert isinstance(entry.sharding, NamedSharding)
            axes = _inside_copies(entry.sharding, entry.leaf.shape, axes, tuple(copies))
        holders = _holders(entry, mine) if axes else None
        if holders is not None:
            assert isinstance(entry, ArrayRead)
            fanned.append(FannedLeaf(position, entry, axes, _my_pieces(entry, holders, balance, me), host is not None))
    taken = {leaf.position for leaf in fanned}
    if not taken:
        return [], plan
    leaves = tuple(NoRead(e.key, None, False) if i in taken else e for i, e in enumerate(plan.leaves))
    kept = (tuple(unit for unit in batch if unit.position not in taken) for batch in plan.batches)
    return fanned, dataclasses.replace(plan, leaves=leaves, batches=tuple(batch for batch in kept if batch))


@functools.lru_cache(maxsize=256)
def _inside_copies(
    sharding: NamedSharding, shape: tuple[int, ...], axes: tuple[str, ...], copies: tuple[frozenset[int], ...]
) -> tuple[str, ...]:
    """Of ``axes``, those along which no step leaves a copy, where then every copy holds every
    shard on exactly one group of devices along them (so one reader per copy and shard, and a
    sum over the group, complete each of its devices); () otherwise. Decided from the target
    and the copies alone: the same on every process (and cached: leaves share layouts)."""
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    copy_of = {p: n for n, copy in enumerate(copies) for p in copy}
    copy = np.vectorize(lambda device: copy_of.get(device.process_index, -1), otypes=[int])(mesh.devices)
    kept = tuple(a for a in axes if (copy == np.take(copy, [0], axis=mesh.axis_names.index(a))).all())
    if not kept or (copy < 0).any() or not _across_processes(mesh, kept):
        return ()
    others = [n for n, name in enumerate(mesh.axis_names) if name not in kept]
    place = {device: tuple(at[n] for n in others) for at, device in np.ndenumerate(mesh.devices)}
    for devices in slice_devices(shape, sharding, True).values():
        groups: dict[int, set[tuple[int, ...]]] = {}
        for device in devices:
            groups.setdefault(copy_of[device.process_index], set()).add(place[device])
        if len(groups) != len(copies) or any(len(g) != 1 for g in groups.values()):
            return ()
    return kept


def _holders(array: ArrayRead | NoRead, readers: Container[int] | None) -> dict[SliceSpec, list[int]] | None:
    """The processes that may read each shard of the leaf, of those holding it; None when
    some shard has none."""
    assert isinstance(array, ArrayRead) and array.sharding is not None
    out = {}
    for region, devices in slice_devices(array.leaf.shape, array.sharding, True).items():
        held = {device.process_index for device in devices}
        out[region] = sorted(p for p in held if readers is None or p in readers)
        if not out[region]:
            return None
    return out


def _my_pieces(
    array: ArrayRead, holders: dict[SliceSpec, list[int]], balance: WriteBalance, me: int
) -> dict[SliceSpec, tuple[PieceEntry, ...]]:
    mine: dict[SliceSpec, list[PieceEntry]] = {region.slice: [] for region in array.regions}
    for region, processes in holders.items():
        for piece in loaded_overlapping(array.leaf, region):
            if piece.length > 0 and balance.assign(processes, piece.length) == me:
                mine[region].append(piece)
    return {region: tuple(pieces) for region, pieces in mine.items()}


def execute(
    fanned: Sequence[FannedLeaf], store: storage.ReadableStore, coord: cluster.Coordinator, batch_bytes: int
) -> tuple[dict[int, object], int]:
    """Every fanned leaf's restored value by plan position, and the bytes this process read."""
    per_device = _device_share(batch_bytes, coord.count)
    by_mesh: dict[Mesh, list[FannedLeaf]] = {}
    for leaf in fanned:
        assert isinstance(leaf.array.sharding, NamedSharding) and isinstance(leaf.array.sharding.mesh, Mesh)
        by_mesh.setdefault(leaf.array.sharding.mesh, []).append(leaf)
    batches = [b for leaves in by_mesh.values() for b in byte_batches(leaves, lambda f: f.device_bytes, per_device)]
    results: dict[int, object] = {}
    total = 0
    for i, batch in enumerate(batches):
        reads = shared_reads.StoreReads(store).start(
            (leaf.array.leaf.key, piece) for leaf in batch for pieces in leaf.mine.values() for piece in pieces
        )
        data = restore_exec.collect(reads)
        inputs = [_bytes_in(leaf, data) for leaf in batch]
        total += sum(chunk.nbytes for chunk in data.values())
        del data
        coord.barrier(f"fan-out {i}")  # names a process that will not join the collective
        outputs = _collective(tuple(_layout(leaf) for leaf in batch))(*inputs)
        jax.block_until_ready(outputs)  # this batch's bytes in go before the next is read
        results.update((leaf.position, _on_host(leaf, out) if leaf.on_host else out)
                       for leaf, out in zip(batch, outputs))
    return results, total


def _device_share(batch_bytes: int, count: int) -> int:
    """One device's part of a read batch (the same on every process)."""
    return max(1, batch_bytes // max(1, jax.device_count() // count))


def _on_host(leaf: FannedLeaf, out: jax.Array) -> object:
    value = np.array(out.addressable_data(0))  # this process's copy, owned and writable
    return value if leaf.array.python_type is None else leaf.array.python_type(value[()].item())


def _bytes_in(leaf: FannedLeaf, data: restore_exec.PieceData) -> jax.Array:
    """The leaf as unsigned integers (:func:`_carrier`) on every device holding it: what
    this process read on the first of its devices holding each shard, zeros elsewhere."""
    array = leaf.array
    assert isinstance(array.sharding, NamedSharding)
    saved = dtype_from_name(array.leaf.dtype)
    carrier, per_item = _carrier(saved)
    shards: list[np.ndarray] = []
    devices: list[jax.Device] = []
    for region in array.regions:
        shape = extent(region.slice)
        filled = np.zeros((*shape, per_item), carrier)
        values = filled.view(saved).reshape(shape)
        for piece in leaf.mine[region.slice]:
            overlap = intersect(piece.slice, region.slice)
            if overlap is not None:
                source = data[(piece.file, piece.offset)].view(saved).reshape(extent(piece.slice))
                values[relative(overlap, region.slice)] = source[relative(overlap, piece.slice)]
        zeros = np.zeros_like(filled) if len(region.devices) > 1 else filled
        shards.extend(filled if j == 0 else zeros for j in range(len(region.devices)))
        devices.extend(region.devices)
    spec = P(*_padded(array.sharding.spec, len(array.leaf.shape)), None)
    sharding = NamedSharding(array.sharding.mesh, spec)
    return jax.make_array_from_single_device_arrays(
        (*array.leaf.shape, per_item), sharding, jax.device_put(shards, devices)
    )


# sharding, replica axes, rank, saved and target dtype
Layout = tuple[NamedSharding, tuple[str, ...], int, np.dtype, np.dtype]


def _layout(leaf: FannedLeaf) -> Layout:
    assert isinstance(leaf.array.sharding, NamedSharding)
    saved = dtype_from_name(leaf.array.leaf.dtype)
    return leaf.array.sharding, leaf.axes, len(leaf.array.leaf.shape), saved, leaf.array.dtype


@functools.lru_cache(maxsize=16)
def _collective(layout: tuple[Layout, ...]):  # noqa: ANN202 - a jitted function
    """One jitted function for a batch: the psum over each leaf's replica axes, then the bytes
    as the saved dtype, cast to the target's. Cached by layout: a restore of the same state
    again compiles nothing."""
    mesh = layout[0][0].mesh
    specs = tuple(P(*_padded(sharding.spec, rank), None) for sharding, _, rank, _, _ in layout)

    def summed(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jax.lax.psum(x, axes) for x, (_, axes, _, _, _) in zip(xs, layout))

    def complete(*xs: jax.Array) -> tuple[jax.Array, ...]:
        ys = jax.shard_map(summed, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)(*xs)
        return tuple(_from_bytes(y, saved, target) for y, (_, _, _, saved, target) in zip(ys, layout))

    return jax.jit(complete, out_shardings=tuple(entry[0] for entry in layout))


def _from_bytes(y: jax.Array, saved: np.dtype, target: np.dtype) -> jax.Array:
    if saved == np.bool_:
        value = y[..., 0] != 0
    else:
        value = jax.lax.bitcast_convert_type(y[..., 0] if saved.itemsize <= 4 else y, saved)
    return value.astype(target)


def _carrier(saved: np.dtype) -> tuple[np.dtype, int]:
    """The unsigned integer type a saved item travels as, and how many of them make one item
    (the trailing axis): wider sums cost the collective fewer elements than bytes would."""
    width = min(saved.itemsize, 4)
    return np.dtype(f"uint{8 * width}"), saved.itemsize // width


def _padded(spec: P, ndim: int) -> tuple:
    return (*spec, *(None,) * (ndim - len(spec)))


def _names(part: object) -> tuple[str, ...]:
    if part is None:
        return ()
    return tuple(part) if isinstance(part, tuple) else (str(part),)


@functools.lru_cache(maxsize=64)
def _across_processes(mesh: Mesh, axes: tuple[str, ...]) -> bool:
    """Whether some shard's replicas live on more than one process, on a mesh over every
    process (so every process takes part in each collective, and all decide alike)."""
    processes = np.vectorize(lambda device: device.process_index, otypes=[int])(mesh.devices)
    if len(np.unique(processes)) != cluster.process_count():
        return False
    return any(
        bool((processes != np.take(processes, [0], axis=mesh.axis_names.index(name))).any()) for name in axes
    )
