"""Format 2's piece-table rows: their layout, and the checks and pieces of rows as read.

A row is 16 bytes: offset, file index, crc32c (``format/_piece_table.py`` writes them). Rows are
checked as columns (numpy, a leaf at a time) and kept so: a pod's million rows cost a few
arrays, and pieces are built only for the leaves a restore places (``format/_table_reads.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format._manifest import MAX_INT, PieceEntry, crc32c

ROW = np.dtype([("offset", "<u8"), ("file", "<u4"), ("crc32c", "<u4")])
ROW_BYTES = ROW.itemsize  # 16


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


class Columns(NamedTuple):
    """Rows as read and checked, cell by cell from ``first``: file indices, offsets, lengths
    (int64), crc32c values, and per axis the cells' start and stop."""

    first: int
    files: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    crcs: np.ndarray
    starts: list[np.ndarray]
    stops: list[np.ndarray]


Bounds = tuple[list[np.ndarray], list[np.ndarray], np.ndarray]  # per axis cells' starts, stops; cells' bytes
_SIZES: dict[int, tuple[list[int], np.ndarray]] = {}  # id(a manifest's file sizes) -> (them, as an array)


def axis_cuts(axis: int | list[int], dim: int) -> list[int]:
    """An axis's cut points from the manifest's step or list."""
    return [*range(0, dim, axis), dim] if isinstance(axis, int) else axis


def columns(ref: TableRef, bounds: Callable[[], Bounds], first: int, count: int, data: bytes | memoryview) -> Columns:
    """The rows of ``count`` cells from ``first``, from ``data`` (as read), each checked
    before use; rows of the whole leaf also against the leaf's crc32c. ``bounds``: those
    cells' (called once the rows are there: a grid's claim alone expands nothing)."""
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
    starts, stops, lengths = bounds()
    room = _size_array(sizes)[files] - offsets
    if (room < lengths).any():
        i = int(np.argmax(room < lengths))
        raise fail(f"place piece {i} at bytes [{int(offsets[i])}, {int(offsets[i]) + int(lengths[i])}) of "
                   f"{names[files[i]]}, past its {sizes[files[i]]} bytes (offset)")
    order = np.lexsort((offsets, files))
    f, o, n = files[order], offsets[order], lengths[order]
    clash = (f[1:] == f[:-1]) & (o[:-1] + n[:-1] > o[1:])
    if clash.any():
        raise fail(f"give two pieces overlapping bytes of {names[f[int(np.argmax(clash))]]} (offset)")
    return Columns(first, files, offsets, lengths, rows["crc32c"], starts, stops)


def whole_columns(data: bytes, leaves: Sequence[tuple[TableRef, Callable[[], Bounds], int]]) -> list[Columns] | None:
    """The columns of several whole leaves' rows (``ref``, its cells' bounds, its first row
    within ``data``, the rows as read), checked as :func:`columns` checks them but in one
    numpy pass (a pod's 2,200 leaves cost a few arrays, not 2,200 passes). None when a check
    fails, the leaves name different files, or some leaf's rows are not in file and offset
    order (as a save writes them): then each is checked alone, which names the fault."""
    refs = [ref for ref, _, _ in leaves]
    view = memoryview(data)
    if any(ref.files is not refs[0].files or not ref.count or (at + ref.count) * ROW_BYTES > len(data)
           or crc32c(view[at * ROW_BYTES : (at + ref.count) * ROW_BYTES]) != ref.crc for ref, _, at in leaves):
        return None
    names, sizes = refs[0].files
    table = np.frombuffer(data, ROW, count=len(data) // ROW_BYTES)
    firsts = [at for _, _, at in leaves]
    stops = [at + ref.count for ref, _, at in leaves]
    contiguous = all(b == a for a, b in zip(stops, firsts[1:]))
    rows = table[firsts[0] : stops[-1]] if contiguous else np.concatenate([table[a:b] for a, b in zip(firsts, stops)])
    files, offsets = rows["file"].astype(np.int64), rows["offset"]
    if int(files.max()) >= len(names) or int(offsets.max()) > MAX_INT:
        return None
    offsets = offsets.astype(np.int64)
    bounds = [bounds() for _, bounds, _ in leaves]
    lengths = np.concatenate([b[2] for b in bounds])
    inside = np.ones(len(files) - 1, dtype=bool)  # pairs of neighbouring rows of one leaf
    inside[np.cumsum([ref.count for ref in refs])[:-1] - 1] = False
    same_file = files[1:] == files[:-1]
    in_order = (files[1:] > files[:-1]) | (same_file & (offsets[1:] >= offsets[:-1]))
    if (_size_array(sizes)[files] - offsets < lengths).any() or not in_order[inside].all() \
            or (inside & same_file & (offsets[:-1] + lengths[:-1] > offsets[1:])).any():
        return None
    out, at = [], 0
    crcs = rows["crc32c"]
    for ref, (starts, stops_, cell_bytes) in zip(refs, bounds):
        part = slice(at, at + ref.count)
        out.append(Columns(0, files[part], offsets[part], cell_bytes, crcs[part], starts, stops_))
        at += ref.count
    return out


def _size_array(sizes: list[int]) -> np.ndarray:
    """The file sizes as an array, made once per manifest rather than once per leaf."""
    hit = _SIZES.get(id(sizes))
    if hit is None or hit[0] is not sizes:
        if len(_SIZES) >= 64:
            _SIZES.clear()
        hit = _SIZES[id(sizes)] = (sizes, np.asarray(sizes, dtype=np.int64))
    return hit[1]


@functools.lru_cache(maxsize=16)
def whole_bounds(layout: tuple[tuple[Any, ...], tuple[int, ...], int]) -> Bounds:
    """Every cell's bounds of a layout (``LazyPieces.layout``: grid, shape, itemsize), made
    once for all the leaves that share it, and shared (read-only)."""
    grid, shape, itemsize = layout
    cuts = [axis_cuts(a if isinstance(a, int) else list(a), n) for a, n in zip(grid, shape)]
    starts, stops, lengths = cell_bounds(cuts, itemsize, 0, math.prod(len(c) - 1 for c in cuts))
    for a in (*starts, *stops, lengths):
        a.flags.writeable = False
    return starts, stops, lengths


def cell_bounds(grid: Sequence[Sequence[int]], itemsize: int, first: int, count: int) -> Bounds:
    """The bounds of ``count`` cells from ``first`` of a grid given by its cut points."""
    cells = np.unravel_index(np.arange(first, first + count), [len(c) - 1 for c in grid]) if grid else ()
    starts = [np.asarray(c, dtype=np.int64)[idx] for c, idx in zip(grid, cells)]
    stops = [np.asarray(c, dtype=np.int64)[idx + 1] for c, idx in zip(grid, cells)]
    lengths = np.full(count, itemsize, dtype=np.int64)
    for a, b in zip(starts, stops):
        lengths *= b - a
    return starts, stops, lengths


def columns_of(ref: TableRef | None, pieces: Sequence[PieceEntry]) -> Columns:
    """The columns of ``pieces`` (as :func:`entries` built them), less the cells' bounds."""
    number = {name: i for i, name in enumerate(ref.files[0])} if ref is not None else {}
    files = np.fromiter((number[p.file] for p in pieces), np.int64, len(pieces))
    offsets, lengths = (np.fromiter((p[i] for p in pieces), np.int64, len(pieces)) for i in (2, 3))
    return Columns(0, files, offsets, lengths, np.fromiter((p.crc32c for p in pieces), np.uint32, len(pieces)), [], [])


def entries(ref: TableRef, columns: Columns) -> tuple[PieceEntry, ...]:
    """The pieces of checked rows."""
    names = ref.files[0]
    bounds = [list(zip(a.tolist(), b.tolist())) for a, b in zip(columns.starts, columns.stops)]
    slices = zip(*bounds) if bounds else [()] * len(columns.files)
    return tuple(
        PieceEntry(tuple(spec), names[fi], off, ln, crc)
        for spec, fi, off, ln, crc in zip(
            slices, columns.files.tolist(), columns.offsets.tolist(), columns.lengths.tolist(), columns.crcs.tolist()
        )
    )
