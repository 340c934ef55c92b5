"""Reading format 2's piece tables: a gridded leaf's rows, whole or only the cells asked for.

Row ``i`` of a leaf is grid cell ``i`` in C order (``format/_piece_table.py``), so the rows that hold
a slice follow from the grid alone: a restoring process reads the rows of the cells its own
devices need (``load_rows``), in runs of neighbouring rows, and builds pieces for those
only, where reading the whole leaf would cost every host the whole pod's rows. A leaf read
whole is checked against its crc32c in the manifest; rows read by the cell (a part of a
leaf: the crc32c covers all its rows) are checked row by row (file index, bytes inside the
file, no two sharing a byte), and each piece's bytes against the crc32c in its row when
read. Planning then looks pieces up in what was loaded, with no IO (``loaded_overlapping``).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format._manifest import MAX_INT, LeafEntry, PieceEntry, crc32c
from tpu_ckpt.format._read_plan import overlapping
from tpu_ckpt.format._slices import SliceSpec

ROW = np.dtype([("offset", "<u8"), ("file", "<u4"), ("crc32c", "<u4")])
ROW_BYTES = ROW.itemsize  # 16
RUN_BYTES = 8 << 20  # the most table bytes one read of several leaves' rows covers


class TableSource:
    """Reads byte ranges of a checkpoint's piece tables: ``read(name, start, length)``, and
    ``where(name)`` names a table in error messages."""

    def __init__(self, read: Callable[[str, int, int], bytes], where: Callable[[str], str]):
        self.read = read
        self.where = where


@dataclasses.dataclass(frozen=True, slots=True)
class TableRef:
    """What a manifest says of one gridded leaf's rows, shared by its ``LazyPieces``."""

    key: str
    table: str
    size: int
    row: int
    count: int
    crc: int
    grid: list[int | list[int]]
    shape: tuple[int, ...]
    itemsize: int
    files: tuple[list[str], list[int]]
    source: TableSource | None


def axis_cuts(axis: int | list[int], dim: int) -> list[int]:
    """An axis's cut points from the manifest's step or list."""
    return [*range(0, dim, axis), dim] if isinstance(axis, int) else axis


class LazyPieces(Sequence[PieceEntry]):
    """A gridded leaf's pieces: all of them, read and checked on first use, or (a restore's
    own share, ``load_rows``) the cells read so far."""

    def __init__(self, ref: TableRef):
        self._ref = ref
        self._pieces: tuple[PieceEntry, ...] | None = None
        self._cells: dict[int, PieceEntry] = {}
        self._lock = threading.Lock()

    @functools.cached_property
    def _cuts(self) -> list[list[int]]:
        """Every axis's cut points: made once rows were read, never from the manifest's claim
        alone (a hostile grid of 2^34 cells must be refused by its missing rows first)."""
        return [axis_cuts(axis, n) for axis, n in zip(self._ref.grid, self._ref.shape)]

    @property
    def loaded(self) -> bool:
        """Whether every row has been read (and checked against the leaf's crc32c)."""
        return self._pieces is not None

    def so_far(self) -> Sequence[PieceEntry]:
        """The pieces loaded so far, whole leaf or cells (no IO)."""
        return self._pieces if self._pieces is not None else list(self._cells.values())

    def cells(self, want: SliceSpec) -> list[int]:
        """The rows (grid cells, C order) of the pieces holding any element of ``want``: from
        the grid alone, no IO. Empty slices hold nothing."""
        ranges = self._cell_ranges(want)
        if ranges is None:
            return []
        if not ranges:
            return [0]
        mesh = np.meshgrid(*(np.arange(first, stop) for first, stop in ranges), indexing="ij")
        counts = [-(-n // axis) if isinstance(axis, int) else len(axis) - 1 for axis, n in zip(self._ref.grid, self._ref.shape)]
        return np.ravel_multi_index(mesh, counts).reshape(-1).tolist()

    def _cell_ranges(self, want: SliceSpec) -> list[tuple[int, int]] | None:
        """Per axis, the first and past-the-last cell holding ``want`` (None: it is empty)."""
        ranges = []
        for (lo, hi), axis in zip(want, self._ref.grid):
            if lo >= hi:
                return None
            if isinstance(axis, int):
                ranges.append((lo // axis, -(-hi // axis)))
            else:
                ranges.append((bisect.bisect_right(axis, lo) - 1, bisect.bisect_left(axis, hi)))
        return ranges

    def _covers_all(self, want: SliceSpec) -> bool:
        ranges = self._cell_ranges(want)
        return ranges is not None and math.prod(stop - first for first, stop in ranges) >= self._ref.count

    def overlapping(self, want: SliceSpec) -> list[PieceEntry]:
        """The loaded pieces holding any element of ``want``; no IO: rows not loaded are an
        error of the caller's, who was to load them first (``load_rows``)."""
        cells = self.cells(want)
        if self._pieces is not None:
            return [self._pieces[c] for c in cells]
        try:
            return [self._cells[c] for c in cells]
        except KeyError:
            raise CheckpointError(f"internal: the rows of key {self._ref.key!r} holding {list(want)} were not loaded") from None

    def missing(self, wants: Iterable[SliceSpec]) -> list[_Span]:
        """The spans of rows not loaded yet that hold ``wants``: the whole leaf when every
        cell is wanted (read and checked whole), else runs of consecutive cells."""
        if self._pieces is not None:
            return []
        wants = list(wants)
        if any(self._covers_all(want) for want in wants):
            return [_Span(self, 0, self._ref.count)]
        wanted = sorted({c for want in wants for c in self.cells(want)} - self._cells.keys())
        if len(wanted) == self._ref.count:
            return [_Span(self, 0, self._ref.count)]
        spans: list[_Span] = []
        for cell in wanted:
            if spans and spans[-1].first + spans[-1].length == cell:
                spans[-1] = spans[-1]._replace(length=spans[-1].length + 1)
            else:
                spans.append(_Span(self, cell, 1))
        return spans

    def _all(self) -> tuple[PieceEntry, ...]:
        if self._pieces is None:
            ref = self._ref
            self._fill(0, ref.count, _read_rows(ref, ref.row, ref.count))
        assert self._pieces is not None
        return self._pieces

    def _fill(self, first: int, count: int, data: bytes) -> None:
        """Loads the rows of ``count`` cells from ``first`` out of ``data`` (as read), checked."""
        entries = _entries(self._ref, self._cuts, first, count, data)
        with self._lock:
            if len(entries) == self._ref.count:
                self._pieces = self._pieces or entries
                self._cells.clear()
            elif self._pieces is None:
                self._cells.update(zip(range(first, first + len(entries)), entries))

    def __len__(self) -> int:
        return self._ref.count

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[PieceEntry]:
        return iter(self._all())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        r = self._ref
        return f"LazyPieces({r.key!r}: rows {r.row}..{r.row + r.count - 1} of {r.table})"


class _Span(NamedTuple):
    """Cells ``first`` to ``first + length`` of one leaf: rows read together."""

    pieces: LazyPieces
    first: int
    length: int

    @property
    def row(self) -> int:
        return self.pieces._ref.row + self.first


def loaded_overlapping(leaf: LeafEntry, want: SliceSpec) -> list[PieceEntry]:
    """:func:`overlapping` with no IO: a gridded leaf's pieces from the rows loaded so far."""
    if isinstance(leaf.pieces, LazyPieces):
        return leaf.pieces.overlapping(want)
    return overlapping(leaf, want)


def load_rows(wants: Iterable[tuple[LeafEntry, Iterable[SliceSpec]]], threads: int) -> None:
    """Reads the rows of the cells of each leaf holding any element of its slices, not yet
    read, in runs (:func:`_runs`), ``threads`` runs at a time, and builds their pieces only."""
    _read([span for leaf, slices in wants if isinstance(leaf.pieces, LazyPieces) for span in leaf.pieces.missing(slices)], threads)


def prefetch(leaves: Sequence[LeafEntry], threads: int) -> None:
    """Reads every row of ``leaves`` not yet read, in runs (on an object store each is a
    request: a full restore's thousands of leaves, one at a time, would cost as many round
    trips). Raises the first leaf's error."""
    lazy = [leaf.pieces for leaf in leaves if isinstance(leaf.pieces, LazyPieces) and not leaf.pieces.loaded]
    _read([_Span(pieces, 0, len(pieces)) for pieces in lazy], threads)


def _read(spans: list[_Span], threads: int) -> None:
    runs = _runs(spans)
    if len(runs) <= 1 or threads <= 1:
        for run in runs:
            _load_run(run)
        return
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(runs))) as pool:
        for _ in pool.map(_load_run, runs):
            pass


def _runs(spans: Sequence[_Span]) -> list[list[_Span]]:
    """The spans as runs of one table each, read with one request per run rather than one
    per leaf (a tree of many small leaves has a row or two per leaf, side by side).

    A span joins the run before it when the rows between them are no more than its own, so
    what a run reads beyond its spans' rows is at most their own bytes (a restore of a few
    leaves, or of a process's cells, reads at most twice their rows, never the table), and
    a run stays within ``RUN_BYTES``."""
    by_table: dict[tuple[int, str], list[_Span]] = {}
    for span in spans:
        by_table.setdefault((id(span.pieces._ref.source), span.pieces._ref.table), []).append(span)
    runs: list[list[_Span]] = []
    for members in by_table.values():
        members.sort(key=lambda s: s.row)
        start = stop = members[0].row
        for span in members:
            end = max(stop, span.row + span.length)
            if span is members[0] or span.row - stop > span.length or (end - start) * ROW_BYTES > RUN_BYTES:
                runs.append([])
                start, end = span.row, span.row + span.length
            runs[-1].append(span)
            stop = end
    return runs


def _load_run(run: Sequence[_Span]) -> None:
    """Reads one run's rows with one request and hands each span its own."""
    start = run[0].row
    stop = max(s.row + s.length for s in run)
    data = _read_rows(run[0].pieces._ref, start, stop - start)
    for span in run:
        span.pieces._fill(span.first, span.length, data[(span.row - start) * ROW_BYTES : (span.row - start + span.length) * ROW_BYTES])


def _read_rows(ref: TableRef, start: int, count: int) -> bytes:
    """Rows ``start`` to ``start + count`` of the table holding ``ref``'s rows."""
    if ref.source is None:
        raise CheckpointError(f"the pieces of key {ref.key!r} are in {ref.table}, and this manifest was read without its tables")
    return bytes(ref.source.read(ref.table, start * ROW_BYTES, count * ROW_BYTES))


def _entries(ref: TableRef, grid: list[list[int]], first: int, count: int, data: bytes) -> tuple[PieceEntry, ...]:
    """The pieces of ``count`` cells from ``first``, from ``data`` (their rows as read), each checked
    before use; rows of the whole leaf also against the leaf's crc32c."""
    where = ref.source.where(ref.table) if ref.source is not None else ref.table

    def fail(problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: rows {ref.row + first}..{ref.row + first + count - 1} (key {ref.key!r}) {problem}; "
            "the checkpoint is damaged, restore another one.",
            key=ref.key, file=where,
        )

    if len(data) != count * ROW_BYTES:
        raise fail(f"are cut short ({len(data)} of {count * ROW_BYTES} bytes)")
    if count == ref.count and crc32c(data) != ref.crc:
        raise fail("do not match their crc32c in the manifest")
    rows = np.frombuffer(data, ROW)
    names, sizes = ref.files
    files = rows["file"].astype(np.int64)
    if len(files) and int(files.max()) >= len(names):
        raise fail(f"name data file {int(files.max())}, and there are {len(names)} (file index)")
    offsets = rows["offset"]
    if len(offsets) and int(offsets.max()) > MAX_INT:
        raise fail("hold an offset past 2^63 (offset)")
    offsets = offsets.astype(np.int64)
    cells = np.unravel_index(np.arange(first, first + count), [len(c) - 1 for c in grid]) if grid else ()
    starts = [np.asarray(c, dtype=np.int64)[idx] for c, idx in zip(grid, cells)]
    stops = [np.asarray(c, dtype=np.int64)[idx + 1] for c, idx in zip(grid, cells)]
    lengths = np.full(count, ref.itemsize, dtype=np.int64)
    for a, b in zip(starts, stops):
        lengths *= b - a
    room = np.asarray(sizes, dtype=np.int64)[files] - offsets
    if (room < lengths).any():
        i = int(np.argmax(room < lengths))
        raise fail(f"place piece {i} at bytes [{int(offsets[i])}, {int(offsets[i]) + int(lengths[i])}) of "
                   f"{names[files[i]]}, past its {sizes[files[i]]} bytes (offset)")
    order = np.lexsort((offsets, files))
    f, o, n = files[order], offsets[order], lengths[order]
    clash = (f[1:] == f[:-1]) & (o[:-1] + n[:-1] > o[1:])
    if clash.any():
        raise fail(f"give two pieces overlapping bytes of {names[f[int(np.argmax(clash))]]} (offset)")
    bounds = [list(zip(a.tolist(), b.tolist())) for a, b in zip(starts, stops)]
    slices = zip(*bounds) if bounds else [()] * count
    return tuple(
        PieceEntry(tuple(spec), names[fi], off, ln, crc)
        for spec, fi, off, ln, crc in zip(slices, files.tolist(), offsets.tolist(), lengths.tolist(), rows["crc32c"].tolist())
    )
