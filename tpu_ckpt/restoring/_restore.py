"""restore() and metadata(): open the checkpoint, load the rows the target needs, plan, carry
the plan out.

``_plan.py`` works out, with no IO, which global slices each target leaf needs on
this process and which pieces hold them, in read batches of about the ``read_batch_bytes`` setting (so
host memory stays at the target's bytes plus two batches); ``restoring/_exec.py`` reads,
assembles and places them. Resharding to another mesh, device count or to numpy is the same
code path. Here: where the bytes come from — storage, the io_device process, or (with
``load_and_broadcast``) the other processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, TypeVar, overload

import numpy as np

from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.catalog import OpenCheckpoint, open_checkpoint
from tpu_ckpt.errors import CheckpointError, TargetMismatchError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    LeafEntry,
    check_byte_ranges,
    dtype_from_name,
    unflatten_nested,
)
from tpu_ckpt.options import CheckpointOptions, checked_options, io_process
from tpu_ckpt.restoring import _exec as restore_exec
from tpu_ckpt.restoring import _fanout as fanout
from tpu_ckpt.restoring import _leaf_kinds as leaf_kinds
from tpu_ckpt.restoring import _shared_reads as shared_reads
from tpu_ckpt.restoring._check import read_batch_bytes
from tpu_ckpt.restoring._mismatch import all_mismatches
from tpu_ckpt.restoring._plan import ArrayRead, RestorePlan, needed_slices, plan_restore
from tpu_ckpt.runtime import gc_paused

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """What :func:`metadata` reports for an array leaf, without reading any data.

    Attributes:
      shape: the global shape.
      dtype: the numpy dtype as saved.
      nbytes: the global array's size in bytes.
      is_slot: whether the leaf is optimizer slot state (``skip_slot_variables`` skips it).
      saved_sharding: the sharding it was saved with, as the manifest records it, or ``None``.
      logical: what a restore makes of it: ``""`` (the array), ``"bytes"``, or
        ``"prng_key:<impl>"`` (a typed PRNG key; ``shape`` and ``dtype`` are its key data's).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    is_slot: bool
    saved_sharding: dict[str, Any] | None
    logical: str = ""


@dataclasses.dataclass(frozen=True)
class PerProcessMetadata:
    """What :func:`metadata` reports for a ``tc.PerProcess`` leaf.

    Attributes:
      process_count: the processes that saved it, one value each.
      sizes: the bytes of process ``p``'s value as stored, at ``sizes[p]``.
    """

    process_count: int
    sizes: tuple[int, ...]


def metadata(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's tree, read from the manifest alone (no data file is opened).

    Args:
      path: the checkpoint directory or URL.

    Returns:
      Nested dicts/lists of :class:`ArrayMetadata` for the arrays, :class:`PerProcessMetadata`
      for the ``tc.PerProcess`` leaves, and the saved Python values.

    Raises:
      CheckpointNotFoundError: nothing is committed at ``path``.
      UncommittedCheckpointError: only a partial, never committed save is there.
      FormatVersionError: a newer format version wrote it.
      CorruptCheckpointError: the manifest is unreadable.
    """
    with open_checkpoint(storage.location(path), threads=1) as checkpoint:
        manifest = checkpoint.manifest
    return unflatten_nested(
        (leaf.path, _leaf_metadata(leaf)) for leaf in manifest.leaves
    )


def _leaf_metadata(leaf: LeafEntry) -> Any:
    if leaf.kind == "value":
        return leaf.value
    if leaf.kind == "array":
        dtype = dtype_from_name(leaf.dtype)
        return ArrayMetadata(leaf.shape, dtype, leaf.nbytes, leaf.is_slot, leaf.sharding, leaf.logical)
    return PerProcessMetadata(len(leaf.pieces), tuple(p.length for p in leaf.pieces))


T = TypeVar("T")


@overload
def restore(
    path: str | os.PathLike[str], target: None = None, *, options: CheckpointOptions | None = None,
    subtree: str | None = None,
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
        variables (decided at save time, see ``sharding/_slots.py``) are not read at all: target slot
        leaves come back unchanged, and without a target they are left out of the result.
      subtree: a key path such as ``"params"``: restore only that part (``target`` then
        describes that part).

    Returns:
      The restored tree: ``target``'s structure with its leaves filled in, or nested
      dicts/lists of numpy arrays and saved Python values without a target.

    Raises:
      CheckpointNotFoundError: nothing is committed at ``path``.
      UncommittedCheckpointError: only a partial, never committed save is there.
      FormatVersionError: a newer format version wrote it.
      CorruptCheckpointError: a data file is missing, truncated or fails its checksum.
      TargetMismatchError: ``target`` or ``subtree`` does not match the checkpoint's tree,
        shapes or dtypes (every mismatch is listed).
    """
    options = checked_options(options, "restore")
    started = time.perf_counter()
    loc = storage.location(path)
    with _open(loc, options) as (checkpoint, coord):
        tree, count, nbytes = restore_from(checkpoint, target, options, subtree, coord)
        relayed = coord is not None and coord.me == options.io_device
    if relayed:  # every process's reads went through this one, which served until all had restored
        relay.note_rate(nbytes * cluster.process_count(), time.perf_counter() - started)
    logger.info(
        "tpu_ckpt: restored %d leaves (%.1f MB read) from %s in %.2fs",
        count, nbytes / 1e6, loc.url, time.perf_counter() - started,
    )
    return tree


@contextlib.contextmanager
def _open(
    loc: storage.Location, options: CheckpointOptions
) -> Iterator[tuple[OpenCheckpoint, cluster.Coordinator | None]]:
    """The open checkpoint, and the coordinator of a restore whose processes work together
    (``io_device``, ``load_and_broadcast``). It is made before anything can fail, so a
    failure on one process reaches the others at once. With ``io_device`` only that process
    opens storage; it serves the others (``relay``) until all have finished."""
    count = cluster.process_count()
    io = io_process(options, count)
    if count == 1 or (io is None and not options.load_and_broadcast):
        with open_checkpoint(loc) as checkpoint:
            yield checkpoint, None
        return
    coord = cluster.Coordinator(f"restore {loc.url}", options.coordination_timeout)
    try:
        if io is None:
            with storage.Store(loc) as store:
                yield cluster.read_manifest_everywhere(coord, loc, lambda _: open_checkpoint(store)), coord
        elif coord.me == io:
            with _serve(loc, coord) as checkpoint:
                yield checkpoint, coord
                coord.collect("restored", "", at=io)  # serves until everyone has restored
        else:
            with relay.RelayStore(loc, _contact(coord, io), coord.timeout, io) as relayed:
                yield open_checkpoint(relayed), coord
            coord.collect("restored", "", at=io)
    except BaseException as error:
        coord.report_failure(error)
        if isinstance(error, relay.RelayConnectionError):  # the peer's own report says more
            coord.raise_if_another_failed("restore", grace=2.0)
        raise
    finally:
        coord.close()


@contextlib.contextmanager
def _serve(loc: storage.Location, coord: cluster.Coordinator) -> Iterator[OpenCheckpoint]:
    """The io_device process: opens the checkpoint (telling the others if that fails, so
    they raise the same error), then serves it while restoring its own part."""
    with storage.Store(loc) as store:
        try:
            checkpoint = open_checkpoint(store)
        except CheckpointError as error:
            coord.publish("serve", "error " + json.dumps(relay.error_to_json(error)))
            raise
        manifest = checkpoint.manifest
        server = relay.RelayServer(
            store, cluster.relay_host(), coord.timeout, peers=coord.count - 1,
            serves={MANIFEST_FILE: None, **manifest.files, **manifest.tables},
        )
        try:
            coord.publish("serve", "ok " + server.contact())
            yield checkpoint
        finally:
            server.close()


def _contact(coord: cluster.Coordinator, io: int) -> str:
    """Every other process: where the io_device process serves the checkpoint, or its error."""
    status, _, detail = coord.receive("serve", io).partition(" ")
    if status == "error":
        raise relay.error_from_json(json.loads(detail))
    return detail


def restore_from(
    checkpoint: OpenCheckpoint, target: Any, options: CheckpointOptions, subtree: str | None,
    coord: cluster.Coordinator | None, *, readers: frozenset[int] | None = None,
    copies: tuple[frozenset[int], ...] | None = None,
) -> tuple[Any, int, int]:
    """The restored tree, its number of leaves and the bytes read: the rows the target
    needs loaded (IO, in runs: with ``load_and_broadcast`` every process's, which it plans
    with), then the plan (pure), then the reads and placement. ``readers`` (with ``coord``):
    only those processes read the leaves a collective completes, for every process (a tier
    restore filling a slice that lost its copy from a whole one); ``copies``: each copy's
    processes read them for their own copy (a tier restore of whole slice copies)."""
    url, skip = checkpoint.location.url, options.skip_slot_variables
    manifest = leaf_kinds.with_per_process_values(checkpoint.store, checkpoint.manifest, target, subtree, url)
    given, target = target, leaf_kinds.stored_target(manifest, target, subtree)
    shared = coord is not None and (options.load_and_broadcast or readers is not None)
    everyone = fanout.fanned_inside(copies) if coord is not None and copies is not None else shared
    checkpoint.load(needed_slices(manifest, target, subtree, skip, everyone=everyone))
    try:
        plan = plan_restore(manifest, target, subtree, skip, batch_bytes=read_batch_bytes(options), url=url)
    except TargetMismatchError as first:  # every mismatch, as tc.check_restore lists them
        raise all_mismatches(first, manifest, target, subtree, skip, url) from None
    if manifest.tables:  # format 2: the pieces loaded share no byte (1.x: checked on decode)
        check_byte_ranges(manifest, checkpoint.where, loaded_only=True)
    if coord is not None and coord.me == options.io_device:  # the others' reads alike, as SPMD restores are
        own = sum(p.length for batch in plan.batches for unit in batch for p in unit.pieces)
        relay.warn_if_beyond("restore", url, own * coord.count, options.coordination_timeout)
    with gc_paused():
        results, nbytes = _carry_out(checkpoint.store, plan, options, coord, readers, copies)
    return leaf_kinds.restored(manifest, plan.tree(results), given, subtree), len(results), nbytes


def _carry_out(
    store: storage.ReadableStore, plan: RestorePlan, options: CheckpointOptions, coord: cluster.Coordinator | None,
    readers: frozenset[int] | None, copies: tuple[frozenset[int], ...] | None,
) -> tuple[list[Any], int]:
    """The plan's reads and placement, and the bytes read: with ``load_and_broadcast`` (or
    ``readers``: the processes that read for the others, a tier's whole slice; or ``copies``),
    first the leaves a collective completes over their replica axes (``_fanout.py``), then the rest."""
    arrays: dict[int, Any] = {}
    fanned_bytes = 0
    shared = options.load_and_broadcast and isinstance(store, storage.CheckpointStore)
    if coord is not None and (shared or readers is not None or copies is not None):
        fanned, plan = fanout.split(plan, coord.me, coord.count, read_batch_bytes(options), readers, copies)
        if fanned:
            arrays, fanned_bytes = fanout.execute(fanned, store, coord, read_batch_bytes(options))
    with _piece_source(store, plan, options, coord) as source:
        results, nbytes = restore_exec.execute(plan, source)
    for position, array in arrays.items():
        results[position] = array
    return results, nbytes + fanned_bytes


@contextlib.contextmanager
def _piece_source(
    store: storage.ReadableStore, plan: RestorePlan, options: CheckpointOptions,
    coord: cluster.Coordinator | None,
) -> Iterator[shared_reads.StoreReads]:
    """Storage, or with ``load_and_broadcast`` storage and the other processes (through a
    store on the storage itself, which ``_open`` opens for it)."""
    if coord is None or not options.load_and_broadcast or not isinstance(store, storage.CheckpointStore):
        yield shared_reads.StoreReads(store)
        return
    arrays = [entry for entry in plan.leaves if isinstance(entry, ArrayRead)]
    the_plan = shared_reads.plan([(a.leaf, a.sharding) for a in arrays], coord.count)
    if not the_plan.readers:  # nothing several processes need (or the collective brought it): no relay
        yield shared_reads.StoreReads(store)
        return
    pieces = {(p.file, p.offset): (a.leaf.key, p) for a in arrays for p in a.leaf.pieces}
    keep = None if options.host_memory_limit is None else options.host_memory_limit // 4
    source = shared_reads.SharedReads(store, coord, the_plan, pieces, keep_bytes=keep)
    try:
        yield source
    except BaseException:
        source.close()
        raise
    source.finish()
