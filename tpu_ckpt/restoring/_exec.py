"""Carries out a :class:`~tpu_ckpt.restoring._plan.RestorePlan`: reads, assembly, placement.

The next batch is being read while the current one is assembled and placed on its devices, and each unit of a batch goes
to its devices as soon as it is assembled, so on an accelerator reading, assembly and host-to-device transfers overlap,
while the host holds at most two batches of read bytes beyond the restored arrays themselves. Pieces are read into fresh
aligned arrays (never mapped: a restored array must not follow later edits of its file); a piece a device holds whole
goes to JAX as that array, with no further copy on CPU. From an object store a piece may instead be a read-only view of
the bytes received: JAX copies it to its device as it would any array, and a numpy result is copied once, so that the
user may write to it.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import PieceEntry, dtype_from_name, extent, intersect, relative
from tpu_ckpt.restoring import _shared_reads as shared_reads
from tpu_ckpt.restoring._plan import ArrayRead, NoRead, Region, RestorePlan, Unit
from tpu_ckpt.settings import settings

_PARALLEL_ASSEMBLY_BYTES = 1 << 20

PieceData = dict[tuple[str, int], np.ndarray]  # each read piece's verified bytes by (file, offset)


def execute(plan: RestorePlan, source: shared_reads.StoreReads) -> tuple[list[Any], int]:
    """One result per plan leaf, and the bytes read. A leaf read region by region (bigger
    than a batch) is assembled from its per-device arrays at the end."""
    results: list[Any] = [entry.value if isinstance(entry, NoRead) else None for entry in plan.leaves]
    placed: dict[int, dict[jax.Device, jax.Array]] = {}
    batches = plan.batches
    total = 0
    pending = _start_reads(source, batches[0]) if batches else None
    for i, batch in enumerate(batches):
        reads = pending if pending is not None else _start_reads(source, batch)
        overlap = i + 1 < len(batches) and plan.overlaps(i)
        pending = _start_reads(source, batches[i + 1]) if overlap else None
        total += _place(batch, collect(reads), results, placed)
    for position, shards in placed.items():
        array = plan.leaves[position]
        assert isinstance(array, ArrayRead) and array.sharding is not None  # placed by region: on devices
        results[position] = jax.make_array_from_single_device_arrays(
            array.leaf.shape, array.sharding, list(shards.values()), dtype=array.dtype
        )
    return results, total


def _place(
    batch: Sequence[Unit], data: PieceData, results: list[Any], placed: dict[int, dict[jax.Device, jax.Array]]
) -> int:
    """Assembles a batch's regions and puts each unit on its devices as soon as it is
    assembled (transfers are asynchronous: on an accelerator the next unit is assembled
    while this one travels); returns the bytes read."""
    sent: list[Any] = []
    for unit, assembled in zip(batch, _assembled(batch, data)):
        array = unit.array
        if array.python_type is not None:
            results[unit.position] = array.python_type(assembled[()].item())
        elif array.sharding is None:
            (results[unit.position],) = map(_owned, assembled.values())
        else:  # each region to its devices, known from the plan (never JAX's map of the job's devices)
            devices = [device for region in unit.regions for device in region.devices]
            hosts = [assembled[region.slice] for region in unit.regions for _ in region.devices]
            shards = jax.device_put(hosts, devices)
            if unit.whole:
                results[unit.position] = jax.make_array_from_single_device_arrays(
                    array.leaf.shape, array.sharding, shards, dtype=array.dtype  # dtype: for a process holding none
                )
            else:
                placed.setdefault(unit.position, {}).update(zip(devices, shards))
            sent.append(shards)
    # Wait for the transfers so that this batch's read bytes can go before the next is read.
    jax.block_until_ready(sent)
    return sum(chunk.nbytes for chunk in data.values())


def _start_reads(source: shared_reads.StoreReads, batch: Sequence[Unit]) -> shared_reads.Reads:
    """Issues every read of a batch at once (checksums are verified in the IO threads)."""
    return source.start((unit.array.leaf.key, p) for unit in batch for p in unit.pieces)


def collect(reads: shared_reads.Reads) -> PieceData:
    """Waits for a batch's reads; returns each piece's verified bytes."""
    out: PieceData = {}
    for read, future in reads:
        try:
            chunks = future.result()
        except CorruptCheckpointError as e:
            if e.key is not None:
                raise
            key = read.pieces[0][0]
            raise CorruptCheckpointError(f"{e} (reading key {key!r})", key=key, file=e.file) from None
        for (_, piece), chunk in zip(read.pieces, read.piece_chunks(chunks)):
            out[(piece.file, piece.offset)] = chunk
    return out


def _assembled(batch: Sequence[Unit], data: PieceData) -> Iterator[dict[Any, np.ndarray]]:
    """Every unit's regions as host arrays, by slice, unit by unit in order. Regions that
    need a copy of a big leaf are assembled on a few threads (numpy releases the GIL while
    copying); the rest inline, where a thread costs more than it saves (a region read whole
    is a view, no copy)."""
    jobs = [[(unit.array, region) for region in unit.regions] for unit in batch]
    heavy = [[_copies(a, r) and a.leaf.nbytes >= _PARALLEL_ASSEMBLY_BYTES for a, r in unit] for unit in jobs]
    threads = min(settings().copy_threads, sum(map(sum, heavy)))
    with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool:
        futures = [
            [pool.submit(_assemble, a, r, data) if h else None for (a, r), h in zip(unit, flags)]
            for unit, flags in zip(jobs, heavy)
        ]
        for unit, jobs_of_unit, unit_futures in zip(batch, jobs, futures):
            arrays = [
                f.result() if f is not None else _assemble(a, r, data) for f, (a, r) in zip(unit_futures, jobs_of_unit)
            ]
            yield {region.slice: array for region, array in zip(unit.regions, arrays)}


def _whole(region: Region) -> bool:
    """Whether the region is exactly one piece (so its bytes are the array, no copy)."""
    pieces = region.pieces
    return len(pieces) == 1 and (pieces[0].slice == region.slice or not region.slice)


def _copies(array: ArrayRead, region: Region) -> bool:
    return not _whole(region) or dtype_from_name(array.leaf.dtype) != array.dtype


def _assemble(array: ArrayRead, region: Region, data: PieceData) -> np.ndarray:
    """The host array for one region, copied out of its pieces."""
    saved = dtype_from_name(array.leaf.dtype)
    shape = extent(region.slice)
    if _whole(region):
        out = _piece_array(region.pieces[0], saved, data).reshape(shape)
    else:
        out = storage.aligned_empty(math.prod(shape) * saved.itemsize).view(saved).reshape(shape)
        for piece in region.pieces:
            overlap = intersect(piece.slice, region.slice)
            if overlap is not None:
                src = _piece_array(piece, saved, data)
                out[relative(overlap, region.slice)] = src[relative(overlap, piece.slice)]
    if out.dtype != array.dtype:
        out = out.astype(array.dtype)
    return out


def _owned(host: np.ndarray) -> np.ndarray:
    """A host array the user may write to: a read-only view of an object store's bytes
    (``object_store._chunks``) copied, once; anything else as it is."""
    return host if host.flags.writeable else host.copy()


def _piece_array(piece: PieceEntry, dtype: np.dtype, data: PieceData) -> np.ndarray:
    shape = extent(piece.slice)
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    try:
        return data[(piece.file, piece.offset)].view(dtype).reshape(shape)
    except KeyError:
        raise CheckpointError(f"internal: piece {piece} was not read") from None
