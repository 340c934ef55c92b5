"""diff(): how two checkpoints differ, from their manifests and (optionally) their data.

The structure (keys, shapes, dtypes, saved Python values) comes from the manifests alone.
Comparing data streams: leaf by leaf, one piece of the first checkpoint at a time with the
pieces of the second that overlap it, so memory is bounded by pieces, never by the size of
the checkpoints, and the two may be cut into pieces differently (saved on other meshes).
Arrays are equal when their bits are: NaN equals NaN with the same payload, and -0.0 differs
from 0.0, since a checkpoint is meant to bring back exactly the bits that were saved.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.catalog._open import open_checkpoint
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import (
    PER_PROCESS,
    LeafEntry,
    PieceEntry,
    Read,
    check_crcs,
    dtype_from_name,
    dtype_itemsize,
    intersect,
    overlapping,
    relative,
)


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference. ``kind``: added, removed, kind (array <-> value), shape, dtype, value
    (a saved Python value), or data (an array's contents, found with ``values=True``)."""

    kind: str
    key: str
    before: str = ""  # the leaf in ``a``, described (e.g. ``float32[8, 4]``) where it matters
    after: str = ""  # the same in ``b``
    differing: int = 0  # data: how many of the leaf's elements differ (bit for bit)
    elements: int = 0  # data: how many elements the leaf has
    max_abs_diff: float = 0.0  # data: the largest |b - a| among those that differ; NaN if one is NaN


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    values: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[Change]:
    """The changes from checkpoint ``a`` to checkpoint ``b``, in tree order.

    With ``values`` the arrays whose key, shape and dtype match are compared bit for bit as
    well (every piece read is crc-checked; a corrupt one raises CorruptCheckpointError).
    ``progress(done, total)`` reports the bytes of ``a`` compared so far.
    """
    # Two IO threads per checkpoint suffice (see _data_changes).
    with open_checkpoint(a, threads=2) as open_a, open_checkpoint(b, threads=2) as open_b:
        leaves_a = {leaf.key: leaf for leaf in open_a.manifest.leaves}
        leaves_b = {leaf.key: leaf for leaf in open_b.manifest.leaves}
        keys = list({**leaves_a, **leaves_b})  # a's keys in tree order, then those only b has
        changes = [c for key in keys for c in _structure(key, leaves_a.get(key), leaves_b.get(key))]
        if values:
            pairs = [(leaf, leaves_b[key]) for key, leaf in leaves_a.items() if _comparable(leaf, leaves_b.get(key))]
            open_a.load_all([x for x, _ in pairs])
            open_b.load_all([y for _, y in pairs])
            changes += _data_changes(open_a.store, open_b.store, pairs, progress)
    order = {key: i for i, key in enumerate(keys)}
    return sorted(changes, key=lambda c: order[c.key])


def _structure(key: str, a: LeafEntry | None, b: LeafEntry | None) -> list[Change]:
    if a is None or b is None:
        if a is None:
            return [Change("added", key, after=_describe(b))]
        return [Change("removed", key, before=_describe(a))]
    if a.kind != b.kind:
        return [Change("kind", key, _describe(a), _describe(b))]
    if a.kind == "value":
        return [] if _same_value(a.value, b.value) else [Change("value", key, repr(a.value), repr(b.value))]
    if a.kind == PER_PROCESS:  # the manifest's crc32c of each process's value tell, with nothing read
        same = [(p.length, p.crc32c) for p in a.pieces] == [(p.length, p.crc32c) for p in b.pieces]
        return [] if same else [Change("value", key, _describe(a), _describe(b))]
    changes = []
    if a.shape != b.shape:
        changes.append(Change("shape", key, str(list(a.shape)), str(list(b.shape))))
    if a.dtype != b.dtype:
        changes.append(Change("dtype", key, a.dtype, b.dtype))
    return changes


def _describe(leaf: Any) -> str:
    if leaf.kind == PER_PROCESS:
        count, crcs = len(leaf.pieces), ",".join(f"{p.crc32c:08x}" for p in leaf.pieces[:4])
        more = "..." if count > 4 else ""
        return f"per-process values of {count} process{'es' if count != 1 else ''} (crc32c {crcs}{more})"
    return f"{leaf.dtype}{list(leaf.shape)}" if leaf.kind == "array" else f"= {leaf.value!r}"


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _comparable(a: LeafEntry, b: LeafEntry | None) -> bool:
    return b is not None and a.kind == b.kind == "array" and a.shape == b.shape and a.dtype == b.dtype


def _data_changes(
    store_a: storage.ReadableStore,
    store_b: storage.ReadableStore,
    pairs: list[tuple[LeafEntry, LeafEntry]],
    progress: Callable[[int, int], None] | None,
) -> list[Change]:
    """The leaves whose data differ, each compared to the end to count its differences. Two
    IO threads per checkpoint suffice: a piece of ``a`` and the pieces of ``b`` it overlaps
    are read at once, and nothing more (more threads would only leave more freed buffers in
    the allocator's per-thread arenas)."""
    report = progress or (lambda done, total: None)
    total, done = sum(a.nbytes for a, _ in pairs), 0
    changes = []
    for a, b in pairs:
        differing, largest = 0, 0.0
        for count, biggest, nbytes in _compared_pieces(store_a, a, store_b, b):
            differing += count
            largest = float(np.maximum(largest, biggest))  # NaN, once met, stays
            done += nbytes
            report(done, total)
        if differing:
            changes.append(
                Change("data", a.key, differing=differing, elements=math.prod(a.shape), max_abs_diff=largest)
            )
    return changes


def _compared_pieces(
    store_a: storage.ReadableStore, a: LeafEntry, store_b: storage.ReadableStore, b: LeafEntry
) -> Iterator[tuple[int, float, int]]:
    """Compares one leaf a piece of ``a`` at a time, yielding (elements that differ, their
    largest |b - a|, bytes) for each. A piece of ``b`` is kept only while pieces of ``a``
    still to come overlap it (``a``'s pieces go in slice order, so that is few)."""
    raw = np.dtype(f"V{dtype_itemsize(a.dtype)}")  # compare bits, whatever the dtype
    plan = [(p, overlapping(b, p.slice)) for p in sorted(a.pieces, key=lambda p: p.slice) if p.length]
    uses = collections.Counter(q for _, overlaps in plan for q in overlaps)
    held: dict[PieceEntry, np.ndarray] = {}
    for piece, overlaps in plan:
        wanted = {q: _start(store_b, b.key, q) for q in overlaps if q not in held}
        mine = _array(_start(store_a, a.key, piece), a.key, piece, raw)
        held.update((q, _array(future, b.key, q, raw)) for q, future in wanted.items())
        differing, largest = 0, 0.0
        for q in overlaps:
            common = intersect(piece.slice, q.slice)
            if common is not None:
                count, biggest = _differences(
                    mine[relative(common, piece.slice)], held[q][relative(common, q.slice)], a.dtype
                )
                differing += count
                largest = float(np.maximum(largest, biggest))  # NaN, once met, stays
            uses[q] -= 1
            if not uses[q]:
                del held[q]
        yield differing, largest, piece.length


def _differences(mine: np.ndarray, theirs: np.ndarray, dtype_name: str) -> tuple[int, float]:
    """How many elements' bits differ, and the largest |theirs - mine| among them (0 for
    -0.0 against 0.0, NaN where either is NaN). Only the differing elements are widened, so
    equal data costs one boolean mask (and no ml_dtypes import for a bfloat16 leaf)."""
    differs = mine != theirs
    count = int(np.count_nonzero(differs))
    if not count:
        return 0, 0.0
    dtype = dtype_from_name(dtype_name)
    wide = np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64
    before, after = (x[differs].view(dtype).astype(wide) for x in (mine, theirs))
    return count, float(np.max(np.abs(after - before)))


def _start(store: storage.ReadableStore, key: str, piece: PieceEntry) -> concurrent.futures.Future:
    read = Read.of(key, piece)
    check = functools.partial(check_crcs, store.location.child(read.file), read)
    return store.read(piece.file, piece.offset, [piece.length], then=check)


def _array(future: concurrent.futures.Future, key: str, piece: PieceEntry, raw: np.dtype) -> np.ndarray:
    try:
        (chunk,) = future.result()
    except CorruptCheckpointError as e:
        if e.key is not None:
            raise
        raise CorruptCheckpointError(f"{e} (reading key {key!r})", key=key, file=e.file) from None
    return chunk.view(raw).reshape(tuple(stop - start for start, stop in piece.slice))
