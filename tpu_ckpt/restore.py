"""restore() and metadata(): manifest -> wanted slices -> ranged reads -> arrays -> tree.

For each target leaf we work out which global slices this process needs (one per distinct
addressable-device index of the target sharding, or the whole array for numpy), read the
pieces that overlap them (each at most once, adjacent ones coalesced, every one crc-checked),
assemble host buffers and place them on the target devices. Resharding to another mesh,
device count or to numpy is the same code path. Reads go in batches of about
``READ_BATCH_BYTES`` so host memory stays at the target's bytes plus one batch. Pieces are
read into fresh aligned arrays (never mapped: a restored array must not follow later edits
of its file); a piece a device holds whole goes to JAX as that array, with no further copy
on CPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np

from tpu_ckpt import (
    distributed,
    keys,
    read_plan,
    relay,
    relay_server,
    relay_wire,
    safe_reads,
    shared_reads,
    shared_storage,
    slices,
    storage,
)
from tpu_ckpt.committed import read_manifest
from tpu_ckpt.decode import decode_manifest
from tpu_ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    TargetMismatchError,
    UncommittedCheckpointError,
)
from tpu_ckpt.format import MANIFEST_FILE, LeafEntry, Manifest, PieceEntry, dtype_from_name
from tpu_ckpt.gc_pause import gc_paused
from tpu_ckpt.options import CheckpointOptions, io_process
from tpu_ckpt.pieces import SliceSpec, full_slice, index_to_slice

logger = logging.getLogger(__name__)

READ_BATCH_BYTES = 256 << 20  # two are in memory at a time: one read, one placed
ASSEMBLY_THREADS = 4
_PARALLEL_ASSEMBLY_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """What :func:`metadata` reports for an array leaf, without reading any data."""

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    is_slot: bool
    saved_sharding: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class _Want:
    """One array leaf to restore and the form it must come back in."""

    leaf: LeafEntry
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None  # None: a numpy array
    python_type: type | None = None  # a Python scalar target: return .item() of this type

    def regions(self) -> dict[SliceSpec, list[jax.Device]]:
        """Each distinct global slice this process needs, with the devices that hold it."""
        if self.sharding is None:
            return {full_slice(self.leaf.shape): []}
        regions: dict[SliceSpec, list[jax.Device]] = {}
        for device, index in self.sharding.addressable_devices_indices_map(self.leaf.shape).items():
            regions.setdefault(index_to_slice(index, self.leaf.shape), []).append(device)
        return regions


@dataclasses.dataclass(frozen=True)
class _Unit:
    """Regions of one leaf read and placed together: the whole leaf, or (for a leaf larger
    than a read batch) a single region."""

    position: int  # the leaf's index in the flattened target
    want: _Want
    regions: dict[SliceSpec, list[jax.Device]]
    whole: bool  # whether ``regions`` is every region of the leaf this process needs

    @functools.cached_property
    def pieces(self) -> list[PieceEntry]:
        """The pieces overlapping this unit's regions (found once: batching and reading both ask)."""
        found = {(p.file, p.offset): p for r in self.regions for p in read_plan.overlapping(self.want.leaf, r)}
        return list(found.values())


def metadata(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's tree as nested dicts/lists of :class:`ArrayMetadata` (and saved
    Python values), read from the manifest alone."""
    manifest = read_manifest(storage.location(path))
    return keys.unflatten_nested(
        (leaf.path, _leaf_metadata(leaf) if leaf.kind == "array" else leaf.value) for leaf in manifest.leaves
    )


def _leaf_metadata(leaf: LeafEntry) -> ArrayMetadata:
    return ArrayMetadata(leaf.shape, dtype_from_name(leaf.dtype), leaf.nbytes, leaf.is_slot, leaf.sharding)


T = TypeVar("T")


@overload
def restore(
    path: str | os.PathLike[str], target: None = None, *, options: CheckpointOptions | None = None, subtree: str | None = None
) -> Any: ...
@overload
def restore(
    path: str | os.PathLike[str], target: T, *, options: CheckpointOptions | None = None, subtree: str | None = None
) -> T: ...
def restore(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    options: CheckpointOptions | None = None,
    subtree: str | None = None,
) -> Any:
    """Restores a checkpoint, or the part of it that ``target`` (and ``subtree``) name.

    Args:
      path: the checkpoint directory or URL.
      target: ``None`` (everything, as nested dicts/lists of numpy arrays and saved Python
        values) or a pytree whose leaves are ``jax.Array``, ``jax.ShapeDtypeStruct``
        (with any sharding), numpy arrays or Python scalars; each restored leaf takes the
        target leaf's shape check, dtype (float->float casts only) and sharding.
      options: :class:`CheckpointOptions`. With ``skip_slot_variables`` the optimizer slot
        variables (decided at save time, see ``slots.py``) are not read at all: target slot
        leaves come back unchanged, and without a target they are left out of the result.
      subtree: a key path such as ``"params"``: restore only that part (``target`` then
        describes that part).

    Raises:
      CheckpointNotFoundError, UncommittedCheckpointError, FormatVersionError,
      CorruptCheckpointError, TargetMismatchError.
    """
    options = options or CheckpointOptions()
    started = time.perf_counter()
    loc = storage.location(path)
    with _open(loc, options) as (store, manifest, coord):
        tree, count, nbytes = _restore_from(store, manifest, target, options, subtree, coord)
    logger.info(
        "tpu_ckpt: restored %d leaves (%.1f MB read) from %s in %.2fs",
        count, nbytes / 1e6, loc.url, time.perf_counter() - started,
    )
    return tree


@contextlib.contextmanager
def _open(
    loc: storage.Location, options: CheckpointOptions
) -> Iterator[tuple[Any, Manifest, distributed.Coordinator | None]]:
    """The checkpoint's store and manifest, and the coordinator of a restore whose processes
    work together (``io_device``, ``load_and_broadcast``). It is made before anything can
    fail, so a failure on one process reaches the others at once. With ``io_device`` only
    that process opens storage; it serves the others (``relay.py``) until all have finished."""
    count = distributed.process_count()
    io = io_process(options, count)
    if count == 1 or (io is None and not options.load_and_broadcast):
        manifest = read_manifest(loc)
        with storage.Store(loc) as store:
            yield store, manifest, None
        return
    coord = distributed.Coordinator(f"restore {loc.url}", options.coordination_timeout)
    try:
        if io is None:
            manifest = shared_storage.read_manifest_everywhere(coord, loc)
            with storage.Store(loc) as store:
                yield store, manifest, coord
        elif coord.me == io:
            with _serve(loc, coord) as (store, manifest):
                yield store, manifest, coord
                coord.gather("restored")
        else:
            with _relayed(loc, coord, io) as (store, manifest):
                yield store, manifest, coord
            coord.gather("restored")
    except BaseException as error:
        coord.report_failure(error)
        if isinstance(error, relay_wire.RelayConnectionError):  # the peer's own report says more
            coord.raise_if_another_failed("restore", grace=2.0)
        raise


@contextlib.contextmanager
def _serve(loc: storage.Location, coord: distributed.Coordinator) -> Iterator[tuple[storage.Store, Manifest]]:
    """The io_device process: reads the manifest (telling the others if that fails, so they
    raise the same error), then serves the checkpoint while restoring its own part."""
    try:
        manifest = read_manifest(loc)
    except CheckpointError as error:
        coord.publish("serve", "error " + json.dumps(relay_wire.error_to_json(error)))
        raise
    with storage.Store(loc) as store:
        server = relay_server.RelayServer(
            store, distributed.relay_host(), coord.timeout, peers=coord.count - 1,
            serves={MANIFEST_FILE: None, **manifest.files},
        )
        try:
            coord.publish("serve", "ok " + server.contact())
            yield store, manifest
        finally:
            server.close()


@contextlib.contextmanager
def _relayed(
    loc: storage.Location, coord: distributed.Coordinator, io: int
) -> Iterator[tuple[relay.RelayStore, Manifest]]:
    """Every other process: reads the checkpoint through the io_device process."""
    status, _, detail = coord.receive("serve", io).partition(" ")
    if status == "error":
        raise relay_wire.error_from_json(json.loads(detail))
    with relay.RelayStore(loc, detail, coord.timeout, io) as store:
        data = store.read_file(MANIFEST_FILE)
        if data is None:
            raise UncommittedCheckpointError(f"{loc.url} lost its {MANIFEST_FILE} during the restore", file=loc.url)
        yield store, decode_manifest(data, where=loc.child(MANIFEST_FILE))


def _restore_from(
    store: storage.Store | relay.RelayStore, manifest: Manifest, target: Any, options: CheckpointOptions,
    subtree: str | None, coord: distributed.Coordinator | None,
) -> tuple[Any, int, int]:
    """The restored tree, its number of leaves and the bytes read."""
    loc = store.location
    prefix = (subtree or "").strip("/")
    leaves = {leaf.key: leaf for leaf in manifest.leaves if keys.under(leaf.key, prefix)}
    if prefix and not leaves:
        raise TargetMismatchError(
            f"subtree {prefix!r} is not in checkpoint {loc.url}; its top-level keys are "
            f"{sorted({leaf.key.split('/')[0] for leaf in manifest.leaves})}",
            key=prefix, file=loc.url,
        )
    skip = options.skip_slot_variables
    if target is None:
        if skip:  # slots are left out of the result altogether
            leaves = {key: leaf for key, leaf in leaves.items() if not leaf.is_slot}
        wanted: list[Any] = [
            _Want(leaf, dtype_from_name(leaf.dtype), None) if leaf.kind == "array" else leaf.value
            for leaf in leaves.values()
        ]
    else:
        flat, treedef = keys.flatten(target)
        wanted = [_want_for(loc, leaves, _join(prefix, key), t, skip) for key, _, t in flat]
    with gc_paused(), _piece_source(store, wanted, options, coord) as source:
        results, nbytes = _restore_leaves(source, wanted)
    if target is not None:
        return jax.tree_util.tree_unflatten(treedef, results), len(results), nbytes
    depth = len(prefix.split("/")) if prefix else 0
    tree = keys.unflatten_nested((leaf.path[depth:], r) for leaf, r in zip(leaves.values(), results))
    return tree, len(results), nbytes


@contextlib.contextmanager
def _piece_source(
    store: storage.Store | relay.RelayStore, wanted: Sequence[Any], options: CheckpointOptions,
    coord: distributed.Coordinator | None,
) -> Iterator[shared_reads.StoreReads]:
    """Storage, or with ``load_and_broadcast`` storage and the other processes."""
    if coord is None or not options.load_and_broadcast:
        yield shared_reads.StoreReads(store)
        return
    wants = [w for w in wanted if isinstance(w, _Want)]
    the_plan = shared_reads.plan([(w.leaf, w.sharding) for w in wants], coord.count)
    pieces = {(p.file, p.offset): (w.leaf.key, p) for w in wants for p in w.leaf.pieces}
    source = shared_reads.SharedReads(store, coord, the_plan, pieces)
    try:
        yield source
    except BaseException:
        source.close()
        raise
    source.finish()


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix and key else prefix or key


def _want_for(loc: storage.Location, leaves: dict[str, LeafEntry], key: str, target: Any, skip_slots: bool) -> Any:
    """What to restore for one target leaf: a :class:`_Want`, or the value itself."""
    leaf = leaves.get(key)
    if leaf is None:
        close = difflib.get_close_matches(key, list(leaves), n=3)
        hint = f"; similar keys: {close}" if close else f"; it has {len(leaves)} leaves under the requested part"
        raise TargetMismatchError(f"Target leaf {key!r} is not in checkpoint {loc.url}{hint}", key=key, file=loc.url)
    if leaf.kind == "value":
        return leaf.value
    if skip_slots and leaf.is_slot:
        return target  # not read; the target's own value comes back unchanged
    if isinstance(target, (bool, int, float)) and not isinstance(target, np.generic):
        # A Python scalar names a kind, not a width: an int target takes any saved integer
        # (signed or not), a float any saved float (bfloat16 and float8 included).
        saved = dtype_from_name(leaf.dtype)
        if isinstance(target, bool):
            same_kind = saved.kind == "b"
        elif isinstance(target, int):
            same_kind = saved.kind in "iu"
        else:
            same_kind = bool(jnp.issubdtype(saved, jnp.floating))
        want = _Want(leaf, saved if same_kind else np.asarray(target).dtype, None, type(target))
        shape = ()
    elif isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = target.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        want, shape = _Want(leaf, np.dtype(target.dtype), sharding), tuple(target.shape)
    elif isinstance(target, (np.ndarray, np.generic)):
        want, shape = _Want(leaf, target.dtype, None), tuple(target.shape)
    else:
        raise TargetMismatchError(
            f"Target leaf {key!r} is a {type(target).__name__}; use a jax.Array, "
            "jax.ShapeDtypeStruct, numpy array or Python scalar",
            key=key,
        )
    if shape != leaf.shape:
        raise TargetMismatchError(
            f"Target leaf {key!r} has shape {shape} but checkpoint {loc.url} saved {leaf.shape}", key=key, file=loc.url
        )
    saved = dtype_from_name(leaf.dtype)
    if want.dtype != saved and not (jnp.issubdtype(want.dtype, jnp.floating) and jnp.issubdtype(saved, jnp.floating)):
        raise TargetMismatchError(
            f"Target leaf {key!r} has dtype {want.dtype} but checkpoint {loc.url} saved {saved}; "
            "only float->float casts are done on restore (no silent int/float conversion)",
            key=key, file=loc.url,
        )
    return want


def _restore_leaves(source: shared_reads.StoreReads, wanted: Sequence[Any]) -> tuple[list[Any], int]:
    """Restores every wanted leaf, reading in batches of about ``READ_BATCH_BYTES``.

    The next batch is being read while the current one is assembled and placed on its
    devices, so the host holds at most two batches of read bytes beyond the restored arrays
    themselves. A leaf larger than a batch is read region by region and assembled from its
    per-device arrays at the end.
    """
    results: list[Any] = list(wanted)
    placed: dict[int, dict[jax.Device, jax.Array]] = {}
    batches = _batches(_units(wanted))
    total = 0
    pending = _start_reads(source, batches[0]) if batches else None
    for i, batch in enumerate(batches):
        reads = pending
        pending = _start_reads(source, batches[i + 1]) if i + 1 < len(batches) else None
        total += _place(batch, _collect(reads), results, placed)
    for position, shards in placed.items():
        want = results[position]
        results[position] = jax.make_array_from_single_device_arrays(want.leaf.shape, want.sharding, list(shards.values()))
    return results, total


def _batches(units: list[_Unit]) -> list[list[_Unit]]:
    batches: list[list[_Unit]] = []
    size = 0
    for unit in units:
        nbytes = sum(p.length for p in unit.pieces)
        if not batches or (batches[-1] and size + nbytes > READ_BATCH_BYTES):
            batches.append([])
            size = 0
        batches[-1].append(unit)
        size += nbytes
    return batches


def _units(wanted: Sequence[Any]) -> list[_Unit]:
    units = []
    for position, want in enumerate(wanted):
        if not isinstance(want, _Want):
            continue
        regions = want.regions()
        if want.leaf.nbytes <= READ_BATCH_BYTES or len(regions) == 1:
            units.append(_Unit(position, want, regions, True))
        else:
            units.extend(_Unit(position, want, {r: d}, False) for r, d in regions.items())
    return units


def _place(
    batch: Sequence[_Unit],
    data: dict[tuple[str, int], np.ndarray],
    results: list[Any],
    placed: dict[int, dict[jax.Device, jax.Array]],
) -> int:
    """Assembles a batch's regions and puts them on their devices; returns the bytes read."""
    all_assembled = _assemble_all(batch, data)
    built, hosts, targets = [], [], []
    for unit, assembled in zip(batch, all_assembled):
        want = unit.want
        if want.python_type is not None:
            results[unit.position] = want.python_type(assembled[()].item())
        elif want.sharding is None:
            (results[unit.position],) = assembled.values()
        elif unit.whole:
            shape = want.leaf.shape
            results[unit.position] = jax.make_array_from_callback(
                shape, want.sharding, lambda index, a=assembled, s=shape: a[index_to_slice(index, s)]
            )
            built.append(results[unit.position])
        else:
            for region, devices in unit.regions.items():
                hosts.extend([assembled[region]] * len(devices))
                targets.extend((unit.position, device) for device in devices)
    transferred = jax.device_put(hosts, [d for _, d in targets])
    for (position, device), array in zip(targets, transferred):
        placed.setdefault(position, {})[device] = array
    # Wait for the transfers so that this batch's read bytes can go before the next is read.
    jax.block_until_ready([built, transferred])
    return sum(chunk.nbytes for chunk in data.values())


def _start_reads(source: shared_reads.StoreReads, batch: Sequence[_Unit]) -> shared_reads.Reads:
    """Issues every read of a batch at once (checksums are verified in the IO threads)."""
    return source.start((unit.want.leaf.key, p) for unit in batch for p in unit.pieces)


def _collect(reads: shared_reads.Reads) -> dict[tuple[str, int], np.ndarray]:
    """Waits for a batch's reads; returns each piece's verified bytes by (file, offset)."""
    out: dict[tuple[str, int], np.ndarray] = {}
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


def _assemble_all(batch: Sequence[_Unit], data: dict[tuple[str, int], np.ndarray]) -> list[dict[SliceSpec, np.ndarray]]:
    """Every unit's regions as host arrays. Big regions are assembled on a few threads (numpy
    releases the GIL while copying); small ones inline, where a thread costs more than it saves."""
    jobs = [(unit.want, region) for unit in batch for region in unit.regions]
    with concurrent.futures.ThreadPoolExecutor(ASSEMBLY_THREADS) as pool:
        futures = [
            pool.submit(_assemble, want, region, data) if want.leaf.nbytes >= _PARALLEL_ASSEMBLY_BYTES else None
            for want, region in jobs
        ]
        arrays = iter([f.result() if f is not None else _assemble(w, r, data) for f, (w, r) in zip(futures, jobs)])
    return [{region: next(arrays) for region in unit.regions} for unit in batch]


def _assemble(want: _Want, region: SliceSpec, data: dict[tuple[str, int], np.ndarray]) -> np.ndarray:
    """The host array for one global slice, copied out of the pieces that overlap it."""
    saved = dtype_from_name(want.leaf.dtype)
    shape = tuple(b - a for a, b in region)
    pieces = read_plan.overlapping(want.leaf, region)
    if len(pieces) == 1 and (pieces[0].slice == region or not region):
        out = _piece_array(pieces[0], saved, data).reshape(shape)
    else:
        out = safe_reads.aligned_empty(math.prod(shape) * saved.itemsize).view(saved).reshape(shape)
        for piece in pieces:
            overlap = slices.intersect(piece.slice, region)
            if overlap is None:
                continue
            src = _piece_array(piece, saved, data)
            out[slices.relative(overlap, region)] = src[slices.relative(overlap, piece.slice)]
    if out.dtype != want.dtype:
        out = out.astype(want.dtype)
    return out


def _piece_array(piece: PieceEntry, dtype: np.dtype, data: dict[tuple[str, int], np.ndarray]) -> np.ndarray:
    shape = tuple(b - a for a, b in piece.slice)
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    try:
        return data[(piece.file, piece.offset)].view(dtype).reshape(shape)
    except KeyError:
        raise CheckpointError(f"internal: piece {piece} was not read") from None
