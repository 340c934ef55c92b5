"""check_restore's reads, counted by layout: a pod's million regions, with no Python per piece.

A restore plans region by region (``_plan.py``): each distinct slice of a leaf, the pieces
holding it, units of a leaf's regions, batches of units, each batch coalesced into requests
(``format.coalesce``, as ``StoreReads`` issues them). Leaves of one layout (grid, shape,
dtype) and target sharding share which rows of their piece table each region needs, so
that is worked out once per layout (:class:`LeafReads`); per leaf only the rows' offsets
differ, and a batch's bytes and requests are numpy over the rows it reads, in one sort of
every loaded row by file and offset. The counts are the planner's, not estimates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt.format import (
    ALIGNMENT,
    MAX_READ_BYTES,
    LeafEntry,
    Manifest,
    SliceSpec,
    byte_batches,
    dtype_from_name,
    extent,
    full_slice,
    piece_cells,
    piece_columns,
    piece_layout,
)
from tpu_ckpt.restoring._plan import ArrayRead, sharded_slices
from tpu_ckpt.sharding import index_to_slice

Unit = tuple[int, np.ndarray, int, int]  # (base row of the leaf, its rows read, their bytes, the regions' bytes)


@dataclasses.dataclass(frozen=True)
class LeafReads:
    """What one process reads of a leaf, grouped as the planner groups its regions (all in
    one unit, or one unit per region for a leaf bigger than a batch): per unit the rows
    (``piece_columns`` order) it reads, their bytes and the bytes of its regions; and
    whether some region is not exactly one saved piece."""

    rows: tuple[np.ndarray, ...]
    piece_bytes: tuple[int, ...]
    region_bytes: tuple[int, ...]
    resharded: bool

    @property
    def read(self) -> int:
        return sum(self.piece_bytes)

    @property
    def over_read(self) -> int:
        return self.read - sum(self.region_bytes)


class ReadCount:
    """Every loaded row of ``manifest`` as columns, sorted once by file and offset; the
    array leaves ``arrays`` (their rows loaded whole) as a restore in batches of
    ``batch_bytes`` reads them."""

    def __init__(self, manifest: Manifest, arrays: Sequence[ArrayRead], batch_bytes: int):
        self._batch_bytes = batch_bytes
        self._memo: dict[Any, Any] = {}
        self._base: dict[str, int] = {}
        ids: dict[str, int] = {}
        maps: dict[int, tuple[Sequence[str], np.ndarray]] = {}  # id(names) -> names, their ids
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        at = 0
        for leaf in manifest.leaves:
            names, files, offsets, lengths = piece_columns(leaf)
            if len(files) and id(names) not in maps:  # the leaves of a table share one list of names
                maps[id(names)] = (names, np.array([ids.setdefault(n, len(ids)) for n in names], dtype=np.int64))
            parts.append((maps[id(names)][1] if len(files) else files, files, offsets, lengths))
            self._base[leaf.key] = at
            at += len(files)
        files, offsets, self._row_lengths = (
            np.concatenate([p[i] for p in parts] or [np.zeros(0, np.int64)]) for i in (1, 2, 3)
        )
        if len(maps) > 1:  # else the ids are the names' own indices
            files = np.concatenate([ids_of[f] for ids_of, f, _, _ in parts])
        self._sizes = np.array([manifest.files.get(name, 0) for name in ids], dtype=np.int64)
        order = _by_file_and_offset(files, offsets, len(ids))
        self._rank = np.empty_like(order)
        self._rank[order] = np.arange(len(order))
        self._sorted = files[order], offsets[order], self._row_lengths[order]  # by file, then offset

    def clash(self) -> bool:
        """Whether two loaded pieces share a byte or one runs past its file (then
        ``format.check_byte_ranges`` names which, as a restore does)."""
        files, starts, lengths = _nonempty(*self._sorted)
        ends = starts + lengths
        return bool((ends > self._sizes[files]).any() or ((files[1:] == files[:-1]) & (ends[:-1] > starts[1:])).any())

    def own(self, array: ArrayRead) -> LeafReads:
        """This process's reads of ``array``: its plan's regions (addressable devices)."""
        shape, sharding = array.leaf.shape, array.sharding
        slices = (full_slice(shape),) if sharding is None else sharded_slices(shape, sharding, False)[1]
        return self._leaf_reads(array.leaf, slices)

    def by_process(
        self, array: ArrayRead, process_of: Callable[[jax.Device], int], processes: Sequence[int]
    ) -> dict[int, LeafReads]:
        """Each process's reads of ``array``, from the sharding's global device map."""
        slices_of = self._process_slices(array, process_of, processes)
        return {p: self._leaf_reads(array.leaf, slices) for p, slices in slices_of.items()}

    def account(self, units: Sequence[Unit]) -> tuple[int, int, int]:
        """Bytes, requests and region bytes of ``units`` read in batches, each batch's rows
        coalesced as ``StoreReads`` issues them (each row once, neighbours in one file
        joined up to ``MAX_READ_BYTES``)."""
        nbytes = requests = 0
        for batch in byte_batches(units, lambda u: u[2], self._batch_bytes):
            picked = np.concatenate([base + rows for base, rows, _, _ in batch])
            files, starts, lengths = _nonempty(*self._batch_rows(picked))
            nbytes += int(lengths.sum())
            requests += _requests(files, starts, lengths)
        return nbytes, requests, sum(u[3] for u in units)

    def _batch_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct ``rows`` sorted by file and offset, as columns."""
        ranks = self._rank[rows]
        if len(ranks) * 8 > len(self._rank):  # a mark per row: no sort
            marked = np.zeros(len(self._rank), dtype=bool)
            marked[ranks] = True
            if marked.all():  # a batch of every row: the columns as they are
                return self._sorted
            ranks = np.flatnonzero(marked)
        else:
            ranks = np.unique(ranks)
        files, starts, lengths = self._sorted
        return files[ranks], starts[ranks], lengths[ranks]

    def units(self, array: ArrayRead, reads: LeafReads) -> list[Unit]:
        base = self._base[array.leaf.key]
        return [(base, rows, n, wanted) for rows, n, wanted in zip(reads.rows, reads.piece_bytes, reads.region_bytes)]

    def _process_slices(
        self, array: ArrayRead, process_of: Callable[[jax.Device], int], processes: Sequence[int]
    ) -> dict[int, tuple[SliceSpec, ...]]:
        """Each process's distinct slices of a leaf, in its devices' order; a leaf without
        sharding is read whole by all."""
        shape, sharding = array.leaf.shape, array.sharding
        if sharding is None:
            return {p: (full_slice(shape),) for p in processes}
        key = ("processes", shape, sharding)
        if key not in self._memo:
            out: dict[int, dict[SliceSpec, None]] = {}
            for device, index in sharding.devices_indices_map(shape).items():
                region = full_slice(shape) if index is None else index_to_slice(index, shape)
                out.setdefault(process_of(device), {})[region] = None
            self._memo[key] = {p: tuple(slices) for p, slices in out.items()}
        return self._memo[key]

    def _leaf_reads(self, leaf: LeafEntry, slices: tuple[SliceSpec, ...]) -> LeafReads:
        layout = piece_layout(leaf)
        if layout is None:
            return self._compute(leaf, slices)
        key = (layout, id(slices))  # one tuple per sharding and shape, kept alive by the memo
        if key not in self._memo or self._memo[key][0] is not slices:
            self._memo[key] = (slices, self._compute(leaf, slices))
        return self._memo[key][1]

    def _compute(self, leaf: LeafEntry, slices: tuple[SliceSpec, ...]) -> LeafReads:
        """As ``_plan._units`` groups the regions ``slices`` of ``leaf``."""
        base = self._base[leaf.key]
        lengths = self._row_lengths[base : base + len(leaf.pieces)]
        found = piece_cells(leaf, slices)
        rows = [np.asarray(cells, dtype=np.int64) for cells, _ in found]
        wanted = [math.prod(extent(s)) * dtype_from_name(leaf.dtype).itemsize for s in slices]
        resharded = any(len(cells) != 1 or (s and first != s) for s, (cells, first) in zip(slices, found))
        if leaf.nbytes <= self._batch_bytes or len(rows) == 1:
            rows = [np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)]
            wanted = [sum(wanted)]
        return LeafReads(tuple(rows), tuple(int(lengths[r].sum()) for r in rows), tuple(wanted), resharded)


def _by_file_and_offset(files: np.ndarray, offsets: np.ndarray, file_count: int) -> np.ndarray:
    """The rows' order by file, then offset. A save writes each file leaf after leaf, so the
    offsets mostly rise already within each file: then a stable sort by file alone (radix, on
    16 bits) is the order, at a third of a full sort's cost."""
    if file_count <= 1 << 16:
        order = np.argsort(files.astype(np.uint16), kind="stable")
        f, o = files[order], offsets[order]
        if ((f[1:] != f[:-1]) | (o[1:] >= o[:-1])).all():
            return order
    return np.lexsort((offsets, files))


def _nonempty(files: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of some bytes (``coalesce`` reads no empty piece)."""
    if lengths.all():
        return files, starts, lengths
    keep = lengths > 0
    return files[keep], starts[keep], lengths[keep]


def _requests(files: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> int:
    """How many reads ``format.coalesce`` makes of these pieces (sorted by file and offset):
    a new read where the file changes or the gap is not padding, and where a run of joined
    pieces would pass ``MAX_READ_BYTES`` (counted one run at a time, only for such runs)."""
    if not len(files):
        return 0
    ends = starts + lengths
    gaps = starts[1:] - ends[:-1]
    new = np.ones(len(files), dtype=bool)
    new[1:] = (files[1:] != files[:-1]) | (gaps < 0) | (gaps >= ALIGNMENT)
    first = np.flatnonzero(new)
    stop = np.append(first[1:], len(files))
    count = len(first)
    too_long = ends[stop - 1] - starts[first] > MAX_READ_BYTES
    for i, j in zip(first[too_long].tolist(), stop[too_long].tolist()):
        count -= 1
        while i < j:  # a read from piece i takes the next pieces while they end within MAX_READ_BYTES of its start
            count += 1
            i += 1 + int(np.searchsorted(ends[i + 1 : j], starts[i] + MAX_READ_BYTES, side="right"))
    return count
