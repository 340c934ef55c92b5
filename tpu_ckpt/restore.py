"""restore() and metadata(): manifest -> wanted slices -> ranged reads -> arrays -> tree.

For each target leaf we work out which global slices this process needs (one per distinct
addressable-device index of the target sharding, or the whole array for numpy), read the
pieces that overlap them (each at most once, adjacent ones coalesced, every one crc-checked),
assemble host buffers and place them on the target devices. Resharding to another mesh,
device count or to numpy is the same code path. Reads go in batches of about
``READ_BATCH_BYTES`` so host memory stays at the target's bytes plus one batch.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpu_ckpt import keys, read_plan, storage
from tpu_ckpt.errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, TargetMismatchError, UncommittedCheckpointError,
)
from tpu_ckpt.format import MANIFEST_FILE, LeafEntry, Manifest, PieceEntry, crc32c, dtype_from_name
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.pieces import SliceSpec, full_slice, index_to_slice

logger = logging.getLogger(__name__)

READ_BATCH_BYTES = 512 << 20


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

    def slices(self) -> list[SliceSpec]:
        if self.sharding is None:
            return [full_slice(self.leaf.shape)]
        indices = self.sharding.addressable_devices_indices_map(self.leaf.shape).values()
        return list(dict.fromkeys(index_to_slice(i, self.leaf.shape) for i in indices))


def read_manifest(loc: storage.Location) -> Manifest:
    """The committed manifest at ``loc``; a typed error if there is none or it is unusable."""
    where = loc.child(MANIFEST_FILE)
    data = storage.Store(loc).read_file(MANIFEST_FILE) if not storage.is_empty(loc) else None
    if data is None:
        if storage.is_empty(loc) and not _has_staging_leftover(loc):
            raise CheckpointNotFoundError(f"No checkpoint at {loc.url}", file=loc.url)
        raise UncommittedCheckpointError(
            f"{loc.url} holds an uncommitted checkpoint (no {MANIFEST_FILE}): its save was "
            "interrupted or failed, so it is not restorable. Restore an earlier checkpoint.",
            file=loc.url,
        )
    return Manifest.from_json(data, where=where)


def _has_staging_leftover(loc: storage.Location) -> bool:
    if not loc.is_local:
        return False
    path = os.path.abspath(loc.local_path.rstrip("/"))
    parent, name = os.path.split(path)
    return os.path.isdir(parent) and any(n.startswith(name + ".tmp-") for n in os.listdir(parent))


def metadata(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's tree as nested dicts/lists of :class:`ArrayMetadata` (and saved
    Python values), read from the manifest alone."""
    manifest = read_manifest(storage.location(path))
    return keys.unflatten_nested(
        (leaf.path, _leaf_metadata(leaf) if leaf.kind == "array" else leaf.value) for leaf in manifest.leaves
    )


def _leaf_metadata(leaf: LeafEntry) -> ArrayMetadata:
    return ArrayMetadata(leaf.shape, dtype_from_name(leaf.dtype), leaf.nbytes, leaf.is_slot, leaf.sharding)


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
      options: :class:`CheckpointOptions`.
      subtree: a key path such as ``"params"``: restore only that part (``target`` then
        describes that part).

    Raises:
      CheckpointNotFoundError, UncommittedCheckpointError, FormatVersionError,
      CorruptCheckpointError, TargetMismatchError.
    """
    options = options or CheckpointOptions()
    if options.skip_slot_variables:
        raise NotImplementedError(
            "skip_slot_variables is not implemented yet (tracked by the serving issue); "
            "restore with a target or subtree that leaves the optimizer out instead."
        )
    started = time.perf_counter()
    loc = storage.location(path)
    manifest = read_manifest(loc)
    prefix = (subtree or "").strip("/")
    leaves = {leaf.key: leaf for leaf in manifest.leaves if keys.under(leaf.key, prefix)}
    if prefix and not leaves:
        raise TargetMismatchError(
            f"subtree {prefix!r} is not in checkpoint {loc.url}; its top-level keys are "
            f"{sorted({leaf.key.split('/')[0] for leaf in manifest.leaves})}",
            key=prefix, file=loc.url,
        )
    if target is None:
        wanted: list[Any] = [
            _Want(leaf, dtype_from_name(leaf.dtype), None) if leaf.kind == "array" else leaf.value
            for leaf in leaves.values()
        ]
    else:
        flat, treedef = keys.flatten(target)
        wanted = [_want_for(loc, leaves, _join(prefix, key), t) for key, _, t in flat]
    results, nbytes = _restore_leaves(storage.Store(loc), wanted)
    logger.info(
        "tpu_ckpt: restored %d leaves (%.1f MB read) from %s in %.2fs",
        len(results), nbytes / 1e6, loc.url, time.perf_counter() - started,
    )
    if target is not None:
        return jax.tree_util.tree_unflatten(treedef, results)
    depth = len(prefix.split("/")) if prefix else 0
    return keys.unflatten_nested((leaf.path[depth:], r) for leaf, r in zip(leaves.values(), results))


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix and key else prefix or key


def _want_for(loc: storage.Location, leaves: dict[str, LeafEntry], key: str, target: Any) -> Any:
    leaf = leaves.get(key)
    if leaf is None:
        close = difflib.get_close_matches(key, list(leaves), n=3)
        hint = f"; similar keys: {close}" if close else f"; it has {len(leaves)} leaves under the requested part"
        raise TargetMismatchError(f"Target leaf {key!r} is not in checkpoint {loc.url}{hint}", key=key, file=loc.url)
    if leaf.kind == "value":
        return leaf.value
    if isinstance(target, (bool, int, float)) and not isinstance(target, np.generic):
        want = _Want(leaf, np.asarray(target).dtype, None, type(target))
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


def _restore_leaves(store: storage.Store, wanted: Sequence[Any]) -> tuple[list[Any], int]:
    """Restores every wanted leaf, reading in batches of about ``READ_BATCH_BYTES``."""
    results: list[Any] = list(wanted)
    batch: list[tuple[int, _Want, list[SliceSpec], list[PieceEntry]]] = []
    batch_bytes = total = 0
    for i, want in enumerate(wanted):
        if not isinstance(want, _Want):
            continue
        slices = want.slices()
        pieces = list({(p.file, p.offset): p for s in slices for p in read_plan.overlapping(want.leaf, s)}.values())
        nbytes = sum(p.length for p in pieces)
        if batch and batch_bytes + nbytes > READ_BATCH_BYTES:
            total += _run_batch(store, batch, results)
            batch, batch_bytes = [], 0
        batch.append((i, want, slices, pieces))
        batch_bytes += nbytes
    if batch:
        total += _run_batch(store, batch, results)
    return results, total


def _run_batch(store: storage.Store, batch: Sequence[tuple[int, _Want, list[SliceSpec], list[PieceEntry]]], results: list[Any]) -> int:
    reads = read_plan.coalesce((want.leaf.key, p) for _, want, _, pieces in batch for p in pieces)
    data = _fetch(store, reads)
    for i, want, slices, _ in batch:
        results[i] = _build(want, slices, data)
    return sum(r.stop - r.start for r in reads)


def _fetch(store: storage.Store, reads: Sequence[read_plan.Read]) -> dict[tuple[str, int], memoryview]:
    """Issues all reads at once; returns each piece's verified bytes by (file, offset)."""
    futures = [(r, store.read(r.file, r.start, r.stop)) for r in reads]
    out: dict[tuple[str, int], memoryview] = {}
    for read, future in futures:
        where = store.location.child(read.file)
        first_key = read.pieces[0][0]
        try:
            result = future.result()
        except ValueError as e:
            raise CorruptCheckpointError(
                f"{where} is truncated: reading bytes [{read.start}, {read.stop}) for key {first_key!r} failed ({e})",
                key=first_key, file=where,
            ) from None
        if result.state == "missing":
            raise CorruptCheckpointError(f"Data file {where} (holding key {first_key!r}) is missing", key=first_key, file=where)
        view = memoryview(result.value)
        if len(view) != read.stop - read.start:
            raise CorruptCheckpointError(f"{where} is truncated (key {first_key!r})", key=first_key, file=where)
        for key, piece in read.pieces:
            chunk = view[piece.offset - read.start : piece.offset - read.start + piece.length]
            if crc32c(chunk) != piece.crc32c:
                raise CorruptCheckpointError(
                    f"crc32c mismatch for key {key!r} slice {list(piece.slice)} in {where}: the file is corrupt",
                    key=key, file=where,
                )
            out[(piece.file, piece.offset)] = chunk
    return out


def _build(want: _Want, slices: list[SliceSpec], data: dict[tuple[str, int], memoryview]) -> Any:
    hosts = {s: _assemble(want, s, data) for s in slices}
    if want.python_type is not None:
        return want.python_type(hosts[()].item())
    if want.sharding is None:
        host = hosts[full_slice(want.leaf.shape)]
        return host if host.flags.writeable else host.copy()
    shape = want.leaf.shape
    return jax.make_array_from_callback(shape, want.sharding, lambda index: hosts[index_to_slice(index, shape)])


def _assemble(want: _Want, region: SliceSpec, data: dict[tuple[str, int], memoryview]) -> np.ndarray:
    """The host array for one global slice, copied out of the pieces that overlap it."""
    saved = dtype_from_name(want.leaf.dtype)
    shape = tuple(b - a for a, b in region)
    pieces = read_plan.overlapping(want.leaf, region)
    if len(pieces) == 1 and (pieces[0].slice == region or not region):
        out = _piece_array(pieces[0], saved, data).reshape(shape)
    else:
        out = np.empty(shape, saved)
        for piece in pieces:
            overlap = read_plan.intersect(piece.slice, region)
            if overlap is None:
                continue
            src = _piece_array(piece, saved, data)
            out[_local(overlap, region)] = src[_local(overlap, piece.slice)]
    if out.dtype != want.dtype:
        out = out.astype(want.dtype)
    return out


def _piece_array(piece: PieceEntry, dtype: np.dtype, data: dict[tuple[str, int], memoryview]) -> np.ndarray:
    shape = tuple(b - a for a, b in piece.slice)
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    try:
        return np.frombuffer(data[(piece.file, piece.offset)], dtype=dtype).reshape(shape)
    except KeyError:
        raise CheckpointError(f"internal: piece {piece} was not read") from None


def _local(region: SliceSpec, within: SliceSpec) -> tuple[slice, ...]:
    return tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(region, within))
