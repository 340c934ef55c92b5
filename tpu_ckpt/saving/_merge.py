"""The leader's merge of every process's index rows, with array operations only.

``merge_rows`` concatenates the binary rows (``format.encode_index``) of every index by
rank into columns, sorts them by leaf and slice start, and proves each leaf's rows are the
cells of a grid, so the piece tables are written straight from the sorted rows: no Python
object per piece, and a pod's 13.5 M pieces cost seconds, not minutes. A leaf whose pieces
form no grid (rare: an uneven cut) keeps them inline and falls back to the per-piece check
(``tiling_problem``), which names what is wrong. Pure: ``saving/_commit.py`` does the IO
around it, and the tier restore's range merge (``tiers/_range_merge.py``) uses it too.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import numpy as np

from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import (
    ROW,
    IndexPlan,
    IndexRows,
    Manifest,
    PieceEntry,
    sort_order,
    tiling_problem,
)

_BY_SLICE = operator.itemgetter(0)  # a PieceEntry's slice


Grid = tuple[list[np.ndarray | tuple[int, int]], np.ndarray]
"""A gridded leaf as the piece table holds it: the cut points per axis, and its rows
(``format.ROW``) in C order of the cells."""


class Grids:
    """Per leaf, its ``Grid`` or None (a value leaf, or one whose pieces stay inline), each
    made when asked for from its column's sorted rows. Built up front, a state of many small
    leaves held a list of cuts and a view of its rows per leaf (~250 B) at the commit's peak,
    beside the plan's own entries: 16 MB of 65,536 leaves of 16 KiB. ``grids[n] = None``
    drops leaf ``n``'s (``format.encode_manifest`` takes each once)."""

    def __init__(self, count: int, dims: np.ndarray):
        self._dims = dims
        self._rank = np.full(count, -1, np.int16)  # per leaf: its column's rank, -1 for no grid
        self._at = np.zeros(count, np.int64)  # per leaf: its run's number in the column
        self._runs: dict[int, tuple[_Columns, np.ndarray, np.ndarray, list[np.ndarray]]] = {}
        self._whole: dict[int, tuple[int, int]] = {}  # an uncut axis's cuts, one object per length

    def add(
        self, column: _Columns, first: np.ndarray, count: np.ndarray, steps: list[np.ndarray], runs: np.ndarray
    ) -> None:
        """The column's runs ``runs`` (numbers into ``first``) are grids."""
        self._runs[column.rank] = (column, first, count, steps)
        leaves = column.leaf[first[runs]].astype(np.int64)
        self._rank[leaves] = column.rank
        self._at[leaves] = runs

    def __len__(self) -> int:
        return len(self._rank)

    def held(self, number: int) -> bool:
        return bool(self._rank[number] >= 0)

    def __getitem__(self, number: int) -> Grid | None:
        rank = int(self._rank[number])
        if rank < 0:
            return None
        column, first, count, steps = self._runs[rank]
        s = int(self._at[number])
        a, n = int(first[s]), int(count[s])
        runs = [n, *(int(step[s]) for step in steps)]  # rows per cell of axis d - 1, then of axis d
        cuts = [
            self._whole.setdefault(int(self._dims[number, d]), (0, int(self._dims[number, d])))
            if runs[d] == runs[d + 1]
            else np.append(column.start[a : a + runs[d] : runs[d + 1], d], self._dims[number, d])
            for d in range(rank)
        ]
        return cuts, column.table[a : a + n]

    def __setitem__(self, number: int, value: None) -> None:
        self._rank[number] = -1

    def tables(self) -> list[np.ndarray]:
        """Every gridded column's rows (``format.ROW``), the views the grids are cut from:
        changing a field here changes every grid's rows (and those of inline leaves too)."""
        return [column.table for column, *_ in self._runs.values()]


def merge_rows(planned: Manifest, plan: IndexPlan, indexes: list[IndexRows]) -> tuple[Manifest, Grids]:
    """``planned`` completed by the binary indexes of every process (emptying ``indexes``,
    so each one's bytes go once copied): the manifest, its gridded leaves' pieces left out,
    and per leaf its grid (None for a value leaf, or one whose pieces stay inline). Raises
    if a leaf's pieces miss, repeat or overlap a block."""
    names, numbers, sizes = _merged_files(indexes)
    columns = _Columns.gather(indexes, numbers)
    grids = Grids(len(planned.leaves), plan.dims)
    inline: dict[int, tuple[PieceEntry, ...]] = {}
    for _, column in sorted(columns.items()):
        column.sort()
        first, count, ok, steps = column.grids(plan.dims)
        grids.add(column, first, count, steps, np.flatnonzero(ok))
        for s in np.flatnonzero(~ok).tolist():
            a, n, number = int(first[s]), int(count[s]), int(column.leaf[first[s]])
            inline[number] = column.pieces(a, a + n, names, int(plan.itemsizes[number]))
    leaves = tuple(  # a leaf without pieces stays the plan's own: no new object per leaf
        dataclasses.replace(e, pieces=inline.get(n, ())) if n in inline or e.pieces else e
        for n, e in enumerate(planned.leaves)
    )
    for number, entry in enumerate(leaves):
        held = grids.held(number)
        problem = (
            None if entry.kind != "array" or held else tiling_problem(entry.shape, [p.slice for p in entry.pieces])
        )
        if problem:
            raise _inconsistent(entry.key, problem)
    return dataclasses.replace(planned, leaves=leaves, files=dict(zip(names, sizes))), grids


def _merged_files(indexes: Sequence[IndexRows]) -> tuple[list[str], list[np.ndarray], list[int]]:
    """Every process's data files, sorted by name, and per index the merged number of each
    of its own files. A name two indexes claim is refused."""
    owner: dict[str, tuple[IndexRows, int]] = {}
    for one in indexes:
        for name, size in zip(one.names, one.sizes.tolist()):
            if name in owner:
                raise CorruptCheckpointError(
                    f"{one.where} and {owner[name][0].where} both claim data file {name}; refusing to commit.",
                    file=one.where,
                )
            owner[name] = (one, size)
    names = sorted(owner)
    number = {name: n for n, name in enumerate(names)}
    numbers = [np.array([number[name] for name in one.names], np.uint32) for one in indexes]
    return names, numbers, [owner[name][1] for name in names]


class _Columns:
    """The rows of one rank from every index, as columns: leaf, table row (offset, merged
    file number, crc32c), slice starts and stops."""

    def __init__(self, rank: int, count: int):
        self.rank = rank
        self.leaf = np.zeros(count, np.uint32)
        self.table = np.zeros(count, ROW)
        self.start = np.zeros((count, rank), np.int64)
        self.stop = np.zeros((count, rank), np.int64)
        self.filled = 0

    @staticmethod
    def gather(indexes: list[IndexRows], numbers: list[np.ndarray]) -> dict[int, _Columns]:
        counts: dict[int, int] = {}
        for one in indexes:
            for rank, rows in one.groups.items():
                counts[rank] = counts.get(rank, 0) + len(rows)
        columns = {rank: _Columns(rank, count) for rank, count in counts.items() if count}
        indexes.reverse()
        numbers = numbers[::-1]
        while indexes:  # each index's bytes go once copied
            one, files = indexes.pop(), numbers.pop()
            for rank, rows in one.groups.items():
                if len(rows):
                    columns[rank].add(rows, files)
        return columns

    def add(self, rows: np.ndarray, files: np.ndarray) -> None:
        a, b = self.filled, self.filled + len(rows)
        self.leaf[a:b] = rows["leaf"]
        self.table["offset"][a:b] = rows["offset"]
        self.table["file"][a:b] = files[rows["file"]]
        self.table["crc32c"][a:b] = rows["crc32c"]
        self.start[a:b] = rows["start"]
        self.stop[a:b] = rows["stop"]
        self.filled = b

    def sort(self) -> None:
        """By leaf, then slice start: a grid's cells in C order."""
        order = sort_order(self.leaf, self.start)
        self.leaf = self.leaf[order]
        self.table = self.table[order]
        self.start = self.start[order]
        self.stop = self.stop[order]

    def grids(self, dims: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
        """Per leaf (a run of sorted rows): its first row, row count, whether its rows are
        exactly the cells of a grid, and per axis the rows between neighbouring cuts."""
        n = len(self.leaf)
        new = np.ones(n, bool)
        np.not_equal(self.leaf[1:], self.leaf[:-1], out=new[1:])
        first = np.flatnonzero(new)
        count = np.diff(np.append(first, n))
        ok = np.ones(len(first), bool)
        steps: list[np.ndarray] = [np.zeros(len(first), np.int64) for _ in range(self.rank)]
        for lo, hi in _chunks(first, count):
            ok[lo:hi], chunk_steps = _grid_check(self, first[lo:hi], count[lo:hi], dims)
            for d in range(self.rank):
                steps[d][lo:hi] = chunk_steps[d]
        return first, count, ok, steps

    def pieces(self, a: int, b: int, names: list[str], itemsize: int) -> tuple[PieceEntry, ...]:
        """Rows ``a`` to ``b`` as pieces, sorted by slice (a leaf that keeps them inline)."""
        pieces = []
        for i in range(a, b):
            spec = tuple(zip(self.start[i].tolist(), self.stop[i].tolist()))
            row = self.table[i]
            length = itemsize * int(np.prod(self.stop[i] - self.start[i]))
            pieces.append(PieceEntry(spec, names[int(row["file"])], int(row["offset"]), length, int(row["crc32c"])))
        return tuple(sorted(pieces, key=_BY_SLICE))


def _chunks(first: np.ndarray, count: np.ndarray, rows: int = 1 << 20) -> list[tuple[int, int]]:
    """Runs of whole leaves of about ``rows`` rows: the grid check's temporaries stay small."""
    bounds = np.searchsorted(np.cumsum(count), np.arange(rows, int(count.sum()), rows), side="right")
    edges = [0, *sorted(set(bounds.tolist()) - {0, len(first)}), len(first)]
    return list(zip(edges[:-1], edges[1:]))


def _grid_check(
    columns: _Columns, first: np.ndarray, count: np.ndarray, dims: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Whether each leaf's sorted rows are exactly the cells of a grid, and its steps.

    In C order, a grid of ``n_0 x ... x n_(r-1)`` cells repeats each start of axis ``d``
    for ``s_d = n_(d+1) ... n_(r-1)`` rows: ``s_d`` is the length of the leaf's first run
    of rows agreeing on axes ``0..d``, the cuts of axis ``d`` are the starts of rows
    ``k s_d``, and row ``i`` must be the cell those cuts give it, its stop the next cut (the
    dimension past the last). With ``s_(r-1) = 1`` (no two rows alike) the rows are then
    every cell once: the leaf is tiled exactly, proven without a Python object per row."""
    lo, hi = int(first[0]), int(first[-1] + count[-1])
    rows = _Rows(
        columns.leaf[lo:hi].astype(np.int64), columns.start[lo:hi], columns.stop[lo:hi], first - lo, count, dims
    )
    changed = np.zeros(hi - lo, bool)
    changed[rows.first] = True
    run, ok, bad, steps = count, np.ones(len(first), bool), np.zeros(hi - lo, bool), []
    for d in range(columns.rank):
        changed[1:] |= rows.start[1:, d] != rows.start[:-1, d]
        starts = np.append(np.flatnonzero(changed), hi - lo)
        step = starts[np.searchsorted(starts, rows.first, side="right")] - rows.first
        ok &= (run % step == 0) & (rows.start[rows.first, d] == 0)
        bad |= rows.start[:, d] >= rows.stop[:, d]
        bad |= rows.stop[:, d] != rows.upper(d, step, run // step)
        run = step
        steps.append(step)
    ok &= (run == 1) & ~np.logical_or.reduceat(bad, rows.first)
    return ok, steps


@dataclasses.dataclass
class _Rows:
    """Some leaves' sorted rows, for the grid check: ``first`` and ``count`` per leaf."""

    leaf: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    first: np.ndarray
    count: np.ndarray
    dims: np.ndarray  # of every leaf of the plan

    def upper(self, d: int, step: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """Each row's stop along axis ``d`` if it is the cell its place says: the next cut,
        or the dimension past the last; -1 (no stop) where its start is not that cell's."""
        n = len(self.leaf)
        if (cells == 1).all():  # the axis is not cut: every row spans it
            return np.where(self.start[:, d] == 0, self.dims[self.leaf, d], -1)
        if (step == 1).all() and (cells == self.count).all():  # the one axis cut: the next row starts where this stops
            ends = np.append(self.first[1:], n) - 1
            upper = np.empty(n, np.int64)
            upper[:-1] = self.start[1:, d]
            upper[ends] = self.dims[self.leaf[ends], d]
            return upper
        segment = np.repeat(np.arange(len(self.first)), self.count)
        s, c = step[segment], cells[segment]
        k = ((np.arange(n) - self.first[segment]) // s) % c
        at = self.first[segment] + k * s
        last = k == c - 1
        upper = np.where(last, self.dims[self.leaf, d], self.start[np.where(last, at, at + s), d])
        return np.where(self.start[:, d] == self.start[at, d], upper, -1)


def _inconsistent(key: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"Leaf {key!r}: {problem}; refusing to commit an inconsistent checkpoint. "
        "Are all processes saving the same tree?",
        key=key,
    )
