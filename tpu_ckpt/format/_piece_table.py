"""Format 2's piece tables: where each piece of a gridded leaf lives, as fixed-width binary rows.

A format 2 manifest keeps the tree (keys, dtypes, shapes, slot flags) and, per array leaf
whose pieces form a grid, the grid's cut points and a reference ``[table, row, count,
crc32c]`` to its rows in a piece table file (``pieces-<n>.bin``). A row is 16 bytes,
little-endian: the piece's offset in its data file (u64), the data file's index (u32) and
the crc32c of its bytes (u32). Row ``i`` of a leaf is grid cell ``i`` in C order, so its
slice and length follow from the grid and the dtype (see FORMAT.md, "Format 2").

A reader loads a leaf's rows only when something asks for its pieces (``LazyPieces``): one
ranged read of exactly that leaf's rows (a restore's leaves are read together, in runs of
neighbouring rows: ``prefetch``), checked against the leaf's crc32c, then row by row
(file index, bytes inside the file, no two pieces of the leaf sharing a byte) before any
piece is used. ``tc.metadata`` therefore reads no table, and restoring one leaf reads only
that leaf's rows.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import _slices as slices
from tpu_ckpt.format._manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_INT,
    LeafEntry,
    Manifest,
    PieceEntry,
    crc32c,
    leaf_to_json,
    seal,
)

ROW = np.dtype([("offset", "<u8"), ("file", "<u4"), ("crc32c", "<u4")])
ROW_BYTES = ROW.itemsize  # 16
MAX_TABLE_ROWS = 1 << 22  # a new table starts past this many rows (64 MiB); a leaf is never split
RUN_BYTES = 8 << 20  # the most table bytes one read of several leaves' rows covers


def table_file(number: int) -> str:
    return f"pieces-{number:05d}.bin"


# -- writing ----------------------------------------------------------------------------


def grid_of(shape: tuple[int, ...], pieces: Sequence[PieceEntry]) -> slices.Grid | None:
    """The cut points per axis and each piece's cell (C order) when ``pieces`` are exactly
    the cells of a grid over ``shape``; None otherwise (those pieces stay inline)."""
    return slices.grid(tuple(shape), tuple(p.slice for p in pieces))


def _axis_json(cuts: list[int], dim: int) -> int | list[int]:
    """An axis's cut points as the manifest holds them: the step when they are evenly spaced
    from 0 (the last cell may be shorter: JAX's uneven shardings), else the list."""
    step = cuts[1] - cuts[0]
    return step if cuts == [*range(0, dim, step), dim] else cuts


def _axis_cuts(axis: int | list[int], dim: int) -> list[int]:
    return [*range(0, dim, axis), dim] if type(axis) is int else axis


def encode_manifest(manifest: Manifest) -> tuple[bytes, dict[str, bytes]]:
    """The sealed format 2 manifest of ``manifest``, and its piece tables by file name (the
    twin of ``decode_manifest``): the tables go first, the manifest (the commit) last. Leaves
    whose pieces form a grid keep their pieces in a table; the others (rare) keep them inline."""
    file_index = {name: i for i, name in enumerate(manifest.files)}
    tables: list[list[bytes]] = []
    sizes: list[int] = []
    leaves = []
    for leaf in manifest.leaves:
        grid = grid_of(leaf.shape, leaf.pieces) if leaf.kind == "array" else None
        doc = leaf_to_json(leaf, file_index, pieces=grid is None)
        if grid is not None:
            cuts, cells = grid
            rows = np.zeros(len(cells), ROW)
            order = np.argsort(np.asarray(cells, dtype=np.int64), kind="stable")
            ordered = [leaf.pieces[i] for i in order]
            rows["offset"] = [p.offset for p in ordered]
            rows["file"] = [file_index[p.file] for p in ordered]
            rows["crc32c"] = [p.crc32c for p in ordered]
            data = rows.tobytes()
            if not tables or sizes[-1] + len(data) > MAX_TABLE_ROWS * ROW_BYTES:
                tables.append([])
                sizes.append(0)
            doc["grid"] = [_axis_json(c, n) for c, n in zip(cuts, leaf.shape)]
            doc["table"] = [len(tables) - 1, sizes[-1] // ROW_BYTES, len(cells), crc32c(data)]
            tables[-1].append(data)
            sizes[-1] += len(data)
        leaves.append(doc)
    names = [table_file(i) for i in range(len(tables))]
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "process_count": manifest.process_count,
        "sharding_callback": manifest.sharding_callback,
        "files": [[name, size] for name, size in manifest.files.items()],
        "tables": [[name, size] for name, size in zip(names, sizes)],
        "leaves": leaves,
    }
    if manifest.source is not None:
        doc["source"] = manifest.source
    if manifest.metrics is not None:
        doc["metrics"] = manifest.metrics
    return seal(json.dumps(doc, separators=(",", ":")).encode()), {n: b"".join(t) for n, t in zip(names, tables)}


def write(
    store: Any, manifest: Manifest, manifest_file: str, check: Callable[[dict[str, int]], None] | None = None
) -> None:
    """Writes ``manifest``'s piece tables, then (once they are durable, and ``check`` of
    their sizes by name has passed) the manifest itself."""
    body, tables = encode_manifest(manifest)
    for future in [store.write(name, [data]) for name, data in tables.items()]:
        future.result()
    if check is not None:
        check({name: len(data) for name, data in tables.items()})
    store.write(manifest_file, [body]).result()


# -- reading ----------------------------------------------------------------------------


class TableSource:
    """Reads byte ranges of a checkpoint's piece tables: ``read(name, start, length)``, and
    ``where(name)`` names a table in error messages."""

    def __init__(self, read: Callable[[str, int, int], bytes], where: Callable[[str], str]):
        self.read = read
        self.where = where


class _Ref:
    """What a manifest says of one gridded leaf's rows, shared by its ``LazyPieces``."""

    __slots__ = ("key", "table", "size", "row", "count", "crc", "grid", "shape", "itemsize", "files", "source")

    def __init__(self, **kw: Any):
        for k, v in kw.items():
            setattr(self, k, v)


class LazyPieces(Sequence[PieceEntry]):
    """A gridded leaf's pieces, read from its piece table on first use and checked then."""

    def __init__(self, ref: _Ref):
        self._ref = ref
        self._pieces: tuple[PieceEntry, ...] | None = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._pieces is not None

    def _all(self) -> tuple[PieceEntry, ...]:
        return self._fill(None)

    def _fill(self, data: bytes | None) -> tuple[PieceEntry, ...]:
        """The pieces, loaded from ``data`` (this leaf's rows, read by a run) or read now."""
        if self._pieces is None:
            with self._lock:
                if self._pieces is None:
                    ref = self._ref
                    self._pieces = _load(ref, _read_rows(ref, ref.row, ref.count) if data is None else data)
        return self._pieces

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


def prefetch(leaves: Sequence[LeafEntry], threads: int) -> None:
    """Reads the rows of ``leaves`` not yet read, in runs (:func:`_runs`), ``threads`` runs
    at a time (on an object store each is a request: a full restore's thousands of leaves,
    one at a time, would cost as many round trips). Raises the first leaf's error."""
    lazy = [leaf.pieces for leaf in leaves if isinstance(leaf.pieces, LazyPieces) and not leaf.pieces.loaded]
    runs = _runs(lazy)
    if len(runs) <= 1 or threads <= 1:
        for run in runs:
            _load_run(run)
        return
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(runs))) as pool:
        for _ in pool.map(_load_run, runs):
            pass


def _runs(lazy: Sequence[LazyPieces]) -> list[list[LazyPieces]]:
    """The leaves' rows as runs of one table each, read with one request per run rather
    than one per leaf (a tree of many small leaves has a row or two per leaf, side by side).

    A leaf joins the run before it when the rows between them are no more than its own, so
    what a run reads beyond its leaves' rows is at most their own bytes (a restore of a few
    leaves reads about their rows, never the table), and a run stays within ``RUN_BYTES``."""
    by_table: dict[tuple[int, str], list[LazyPieces]] = {}
    for pieces in lazy:
        by_table.setdefault((id(pieces._ref.source), pieces._ref.table), []).append(pieces)
    runs: list[list[LazyPieces]] = []
    for members in by_table.values():
        members.sort(key=lambda p: p._ref.row)
        start = stop = members[0]._ref.row
        for pieces in members:
            ref = pieces._ref
            end = max(stop, ref.row + ref.count)
            if pieces is members[0] or ref.row - stop > ref.count or (end - start) * ROW_BYTES > RUN_BYTES:
                runs.append([])
                start, end = ref.row, ref.row + ref.count
            runs[-1].append(pieces)
            stop = end
    return runs


def _load_run(run: Sequence[LazyPieces]) -> None:
    """Reads one run's rows with one request and hands each leaf its own."""
    first = run[0]._ref
    start = first.row
    stop = max(p._ref.row + p._ref.count for p in run)
    data = _read_rows(first, start, stop - start)
    for pieces in run:
        ref = pieces._ref
        pieces._fill(data[(ref.row - start) * ROW_BYTES : (ref.row - start + ref.count) * ROW_BYTES])


def _read_rows(ref: _Ref, start: int, count: int) -> bytes:
    """Rows ``start`` to ``start + count`` of the table holding ``ref``'s rows."""
    if ref.source is None:
        raise CheckpointError(f"the pieces of key {ref.key!r} are in {ref.table}, and this manifest was read without its tables")
    return bytes(ref.source.read(ref.table, start * ROW_BYTES, count * ROW_BYTES))


def _load(ref: _Ref, data: bytes) -> tuple[PieceEntry, ...]:
    """A leaf's pieces from ``data``, its rows as read, each checked before use."""
    where = ref.source.where(ref.table) if ref.source is not None else ref.table

    def fail(problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: rows {ref.row}..{ref.row + ref.count - 1} (key {ref.key!r}) {problem}; "
            "the checkpoint is damaged, restore another one.",
            key=ref.key, file=where,
        )

    if len(data) != ref.count * ROW_BYTES:
        raise fail(f"are cut short ({len(data)} of {ref.count * ROW_BYTES} bytes)")
    if crc32c(data) != ref.crc:
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
    grid = [_axis_cuts(axis, n) for axis, n in zip(ref.grid, ref.shape)]  # as many cells as rows
    counts = [len(c) - 1 for c in grid]
    widths = [np.diff(np.asarray(c, dtype=np.int64)) for c in grid]
    lengths = np.full(1, ref.itemsize, dtype=np.int64)
    for w in widths:
        lengths = np.multiply.outer(lengths, w).reshape(-1)
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
    crcs = rows["crc32c"].tolist()
    cells = np.unravel_index(np.arange(ref.count), counts) if counts else ()
    starts = [[c[i] for i in idx.tolist()] for c, idx in zip(grid, cells)]
    stops = [[c[i + 1] for i in idx.tolist()] for c, idx in zip(grid, cells)]
    rank = len(counts)
    return tuple(
        PieceEntry(tuple((starts[d][i], stops[d][i]) for d in range(rank)), names[fi], off, ln, crc)
        for i, (fi, off, ln, crc) in enumerate(zip(files.tolist(), offsets.tolist(), lengths.tolist(), crcs))
    )


def lazy_pieces(
    decoder: Any, doc: dict[str, Any], field: str, key: str, shape: tuple[int, ...], itemsize: int,
    files: tuple[list[str], list[int]], tables: list[tuple[str, int]], source: TableSource | None,
) -> LazyPieces:
    """A table leaf's pieces, its manifest fields checked (the rows are checked on load)."""
    t, row, count, crc = decoder.list(doc.get("table"), f"{field}.table", 4)
    t = decoder.int(t, f"{field}.table (table index)", len(tables) - 1)
    row = decoder.int(row, f"{field}.table (row)")
    count = decoder.int(count, f"{field}.table (count)")
    crc = decoder.int(crc, f"{field}.table (crc32c)", 0xFFFFFFFF)
    raw = decoder.list(doc.get("grid"), f"{field}.grid", len(shape))
    grid: list[int | list[int]] = []
    cells = []
    for d, (axis, n) in enumerate(zip(raw, shape)):
        if type(axis) is int:  # a step: cuts 0, step, 2 step, ..., n (expanded on load)
            if not 1 <= axis <= n:
                raise decoder.fail(f"{field}.grid[{d}]", f"must be a step in [1, {n}] or a list of cut points, got {_short(axis)}")
            grid.append(axis)
            cells.append(-(-n // axis))
            continue
        cuts = [decoder.int(c, f"{field}.grid[{d}]", n) for c in decoder.list(axis, f"{field}.grid[{d}]")]
        if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != n or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise decoder.fail(f"{field}.grid[{d}]", f"must rise strictly from 0 to {n}, got {_short(cuts)}")
        grid.append(cuts)
        cells.append(len(cuts) - 1)
    if count != math.prod(cells):
        raise decoder.fail(f"{field}.table (count)", f"is {count}, but the grid has {math.prod(cells)} cells")
    name, size = tables[t]
    if row + count > size // ROW_BYTES:
        raise decoder.fail(f"{field}.table", f"names rows {row}..{row + count - 1}, past the {size // ROW_BYTES} rows of {name}")
    if math.prod(shape) * itemsize > MAX_INT:
        raise decoder.fail(f"{field}.shape", "holds more than 2^63 bytes")
    return LazyPieces(_Ref(key=key, table=name, size=size, row=row, count=count, crc=crc, grid=grid, shape=shape,
                           itemsize=itemsize, files=files, source=source))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
