"""Reading format 2's piece tables: a gridded leaf's rows, whole or only the cells asked for.

Row ``i`` of a leaf is grid cell ``i`` in C order (``format/_piece_table.py``), so the rows that hold a slice follow
from the grid alone: a restoring process reads the rows of the cells its own devices need (``load_rows``), in runs of
neighbouring rows, and builds pieces for those only, where reading the whole leaf would cost every host the whole pod's
rows. A leaf read whole is checked against its crc32c in the manifest; rows read by the cell (a part of a leaf: the
crc32c covers all its rows) are checked row by row (file index, bytes inside the file, no two sharing a byte), and each
piece's bytes against the crc32c in its row when read. Planning then looks pieces up in what was loaded, with no IO
(``loaded_overlapping``). Rows read whole are kept as columns, checked a run of leaves at a time, and pieces built from
them only when asked for: ``check_restore`` counts a pod's million in numpy (``piece_columns``).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import _table_rows as table_rows
from tpu_ckpt.format._manifest import LeafEntry, PieceEntry
from tpu_ckpt.format._read_plan import overlapping
from tpu_ckpt.format._slices import SliceSpec
from tpu_ckpt.format._table_rows import ROW as ROW  # the face's and _piece_table's names, from here
from tpu_ckpt.format._table_rows import ROW_BYTES, TableRef, axis_cuts
from tpu_ckpt.format._table_rows import TableSource as TableSource

RUN_BYTES = 8 << 20  # the most table bytes one read of several leaves' rows covers


_AS_PIECES = table_rows.columns_of(None, ())  # ``_whole`` of a leaf whose rows are kept as its pieces
_LOCK = threading.Lock()  # guards every leaf's loaded rows: held for no IO, and a lock per leaf costs ~90 bytes


class LazyPieces(Sequence[PieceEntry]):
    """A gridded leaf's pieces: all, read and checked on first use, or (``load_rows``) the cells read so far.
    Slots, and its rows kept either as columns or as pieces: a state of many small leaves has one a leaf."""

    __slots__ = ("_ref", "_whole", "_pieces", "_cells", "_made_cuts")

    def __init__(self, ref: TableRef):
        self._ref = ref
        self._whole: table_rows.Columns | None = None  # every row, read and checked
        self._pieces: tuple[PieceEntry, ...] | None = None  # built from ``_whole`` when first asked for
        self._cells: dict[int, PieceEntry] = {}
        self._made_cuts: list[list[int]] | None = None

    @property
    def _cuts(self) -> list[list[int]]:
        """Every axis's cut points: made once rows were read, never from the manifest's claim alone
        (a hostile grid of 2^34 cells must be refused by its missing rows first)."""
        if self._made_cuts is None:
            self._made_cuts = [axis_cuts(axis, n) for axis, n in zip(self._ref.grid, self._ref.shape)]
        return self._made_cuts

    @property
    def _counts(self) -> list[int]:  # every axis's cell count, from the manifest's grid (no cut list is expanded)
        grid = zip(self._ref.grid, self._ref.shape)
        return [-(-n // axis) if isinstance(axis, int) else len(axis) - 1 for axis, n in grid]

    @property
    def layout(self) -> tuple[Any, ...]:
        """What decides which rows hold a slice and each row's bytes (made at each call): leaves
        of one layout share them (a caller plans such leaves once, ``restoring/_check_reads.py``)."""
        return tuple(a if isinstance(a, int) else tuple(a) for a in self._ref.grid), self._ref.shape, self._ref.itemsize

    @property
    def loaded(self) -> bool:
        """Whether every row has been read (and checked against the leaf's crc32c)."""
        return self._whole is not None

    def so_far(self) -> Sequence[PieceEntry]:
        """The pieces loaded so far, whole leaf or cells (no IO)."""
        return self._all() if self._whole is not None else list(self._cells.values())

    def cells(self, want: SliceSpec) -> list[int]:
        """The rows (grid cells, C order) of the pieces holding any element of ``want``: from
        the grid alone, no IO. Empty slices hold nothing. A region of one cell (a restore onto
        the saved layout: every region) is one index, with no array built."""
        ranges = self._cell_ranges(want)
        if ranges is None:
            return []
        if all(stop - first == 1 for first, stop in ranges):
            cell = 0
            for (first, _), count in zip(ranges, self._counts):
                cell = cell * count + first
            return [cell]
        mesh = np.meshgrid(*(np.arange(first, stop) for first, stop in ranges), indexing="ij")
        return np.ravel_multi_index(mesh, self._counts).reshape(-1).tolist()

    def columns(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Every row as columns, in cell order: the data file names, and per row its file's
        index among them, offset and length (int64); the rows are read first if need be.
        No piece is built: what a check of a pod's million pieces needs."""
        whole = self._load_whole()
        whole = table_rows.columns_of(self._ref, self._all()) if whole is _AS_PIECES else whole
        return self._ref.files[0], whole.files, whole.offsets, whole.lengths

    def cell_slice(self, cell: int) -> SliceSpec:
        """The slice of the piece in ``cell`` (from the grid, no IO)."""
        index = np.unravel_index(cell, self._counts) if self._counts else ()
        return tuple((cuts[i], cuts[i + 1]) for cuts, i in zip(self._cuts, map(int, index)))

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
        if self._whole is not None:
            pieces = self._all()
            return [pieces[c] for c in cells]
        try:
            return [self._cells[c] for c in cells]
        except KeyError:
            missing = f"the rows of key {self._ref.key!r} holding {list(want)}"
            raise CheckpointError(f"internal: {missing} were not loaded") from None

    def missing(self, wants: Iterable[SliceSpec]) -> list[_Span]:
        """The spans of rows not loaded yet that hold ``wants``: the whole leaf when every
        cell is wanted (read and checked whole), else runs of consecutive cells."""
        if self._whole is not None:
            return []
        needed = _needed_cells(self, wants)
        if needed is None:
            return [_Span(self, 0, self._ref.count)]
        wanted = sorted(needed - self._cells.keys())
        if len(wanted) == self._ref.count:
            return [_Span(self, 0, self._ref.count)]
        ends = [i for i in range(1, len(wanted)) if wanted[i] != wanted[i - 1] + 1]  # where a run of cells breaks
        return [_Span(self, wanted[a], b - a) for a, b in zip([0, *ends], [*ends, len(wanted)]) if b > a]

    def _load_whole(self) -> table_rows.Columns:
        if self._whole is None:
            ref = self._ref
            self._fill(0, ref.count, _read_rows(ref, ref.row, ref.count))
        assert self._whole is not None
        return self._whole

    def _bounds(self, first: int, count: int) -> table_rows.Bounds:
        if first == 0 and count == self._ref.count:
            return table_rows.whole_bounds(self.layout)
        return table_rows.cell_bounds(self._cuts, self._ref.itemsize, first, count)

    def _all(self) -> tuple[PieceEntry, ...]:
        whole = self._load_whole()
        with _LOCK:
            if self._pieces is None:
                self._pieces = table_rows.entries(self._ref, whole)
                self._whole = _AS_PIECES  # every row loaded; the columns go (~0.3 KB a leaf of views)
            return self._pieces

    def _fill(self, first: int, count: int, data: bytes | memoryview) -> None:
        """Loads the rows of ``count`` cells from ``first`` out of ``data`` (as read), checked;
        a whole leaf's as columns only (its pieces are built when first asked for)."""
        self._keep(table_rows.columns(self._ref, lambda: self._bounds(first, count), first, count, data))

    def _keep(self, columns: table_rows.Columns) -> None:
        first, count = columns.first, len(columns.files)
        entries = () if count == self._ref.count else table_rows.entries(self._ref, columns)
        with _LOCK:
            if count == self._ref.count:
                self._whole = self._whole or columns
                self._cells.clear()
            elif self._whole is None:
                self._cells.update(zip(range(first, first + count), entries))

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


_NEEDED: dict[tuple[Any, int], tuple[Any, frozenset[int] | None]] = {}  # (layout, id(wants)) -> (wants, cells)


def _needed_cells(pieces: LazyPieces, wants: Iterable[SliceSpec]) -> frozenset[int] | None:
    """The cells holding any of ``wants``; None when one want covers every cell. A tuple of
    wants (a planner's, shared by every leaf of one target sharding, ``restoring/_plan.py``)
    is looked at once per layout, not once per leaf: a pod's 2,200 leaves of 512 regions
    would otherwise cost a million lookups. The tuple is kept, so its id is not reused."""
    if not isinstance(wants, tuple):
        return _cells_of(pieces, list(wants))
    key = (pieces.layout, id(wants))
    hit = _NEEDED.get(key)
    if hit is None or hit[0] is not wants:
        if len(_NEEDED) >= 256:
            _NEEDED.clear()
        hit = _NEEDED[key] = (wants, _cells_of(pieces, wants))
    return hit[1]


def _cells_of(pieces: LazyPieces, wants: Sequence[SliceSpec]) -> frozenset[int] | None:
    if any(pieces._covers_all(want) for want in wants):
        return None
    return frozenset(c for want in wants for c in pieces.cells(want))


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


def piece_columns(leaf: LeafEntry) -> tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of ``leaf`` loaded so far as columns: data file names, and per piece its
    file's index among them, its offset and its length (int64). A gridded leaf read whole
    gives its rows in cell order with no piece built (``check_restore`` on a million)."""
    pieces = leaf.pieces
    if isinstance(pieces, LazyPieces) and pieces.loaded:
        return pieces.columns()
    found = pieces.so_far() if isinstance(pieces, LazyPieces) else pieces
    names = list(dict.fromkeys(p.file for p in found))
    index = {name: i for i, name in enumerate(names)}
    files = np.array([index[p.file] for p in found], dtype=np.int64)
    offsets = np.array([p.offset for p in found], dtype=np.int64)
    return names, files, offsets, np.array([p.length for p in found], dtype=np.int64)


def piece_layout(leaf: LeafEntry) -> Any:
    """A key equal for leaves whose slices lie in the same rows of ``piece_columns``, rows of
    the same lengths and slices (a gridded leaf's grid, shape and itemsize); None: its own."""
    return leaf.pieces.layout if isinstance(leaf.pieces, LazyPieces) else None


def piece_cells(leaf: LeafEntry, wants: Sequence[SliceSpec]) -> list[tuple[list[int], SliceSpec | None]]:
    """Per want, the rows of ``piece_columns`` holding any element of it (a leaf read whole),
    and the slice of the first such piece (None: no piece holds it)."""
    pieces = leaf.pieces
    if isinstance(pieces, LazyPieces):
        found = [pieces.cells(want) for want in wants]
        return [(cells, pieces.cell_slice(cells[0]) if cells else None) for cells in found]
    index = {id(p): i for i, p in enumerate(pieces)}
    holders = (overlapping(leaf, w) for w in wants)
    return [([index[id(p)] for p in hold], hold[0].slice if hold else None) for hold in holders]


def load_rows(wants: Iterable[tuple[LeafEntry, Iterable[SliceSpec]]], threads: int) -> None:
    """Reads the rows of the cells of each leaf holding any element of its slices, not yet
    read, in runs (:func:`_runs`), ``threads`` runs at a time, and builds their pieces only."""
    lazy = [(leaf.pieces, slices) for leaf, slices in wants if isinstance(leaf.pieces, LazyPieces)]
    _read([span for pieces, slices in lazy for span in pieces.missing(slices)], threads)


def prefetch(leaves: Sequence[LeafEntry], threads: int) -> None:
    """Reads every row of ``leaves`` not yet read, in runs (on an object store each is a request: a full restore's
    thousands of leaves, one at a time, would cost as many round trips). Raises the first leaf's error."""
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

    A span joins the run before it when the rows between them are no more than its own, so what a run reads beyond its
    spans' rows is at most their own bytes (a restore of a few leaves, or of a process's cells, reads at most twice
    their rows, never the table), and a run stays within ``RUN_BYTES``."""
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
    whole = [span for span in run if span.first == 0 and span.length == span.pieces._ref.count]
    found = None
    if len(whole) > 1:  # checked together, in one numpy pass; else (or if one fails) leaf by leaf
        refs = [(s.pieces._ref, functools.partial(s.pieces._bounds, 0, s.length), s.row - start) for s in whole]
        found = table_rows.whole_columns(data, refs)
    for span, columns in zip(whole, found or ()):
        span.pieces._keep(columns)
    kept = {id(span) for span in whole} if found is not None else set()
    view = memoryview(data)
    for span in run:
        if id(span) not in kept:
            at = span.row - start
            span.pieces._fill(span.first, span.length, view[at * ROW_BYTES : (at + span.length) * ROW_BYTES])


def _read_rows(ref: TableRef, start: int, count: int) -> bytes:
    """Rows ``start`` to ``start + count`` of the table holding ``ref``'s rows."""
    if ref.source is None:
        raise CheckpointError(f"the pieces of key {ref.key!r} are in {ref.table}, "
                              "and this manifest was read without its tables")
    return bytes(ref.source.read(ref.table, start * ROW_BYTES, count * ROW_BYTES))
