"""Format 2's piece tables: where each piece of a gridded leaf lives, as fixed-width binary rows.

A format 2 manifest keeps the tree (keys, dtypes, shapes, slot flags) and, per array leaf
whose pieces form a grid, the grid's cut points and a reference ``[table, row, count,
crc32c]`` to its rows in a piece table file (``pieces-<n>.bin``). A row is 16 bytes,
little-endian: the piece's offset in its data file (u64), the data file's index (u32) and
the crc32c of its bytes (u32). Row ``i`` of a leaf is grid cell ``i`` in C order, so its
slice and length follow from the grid and the dtype (see FORMAT.md, "Format 2").

A reader loads rows only when something asks for their pieces (``table_reads.py``): a
leaf's rows whole, or a restoring process's own cells, in runs of neighbouring rows, each
checked before any piece is used. ``tc.metadata`` therefore reads no table, and restoring
one leaf reads only that leaf's rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from tpu_ckpt.format import _slices as slices
from tpu_ckpt.format._manifest import (
    FORMAT_NAME,
    MAX_INT,
    LeafEntry,
    Manifest,
    PieceEntry,
    crc32c,
    leaf_to_json,
    sealed_parts,
    version_for,
)
from tpu_ckpt.format._names import table_file
from tpu_ckpt.format._table_reads import ROW, ROW_BYTES, LazyPieces, TableRef, TableSource

MAX_TABLE_ROWS = 1 << 22  # a new table starts past this many rows (64 MiB); a leaf is never split


# -- writing ----------------------------------------------------------------------------


class GridSource(Protocol):
    """Per leaf, its cut points and rows when the caller has them (a list, or the leader's
    merge: ``saving.Grids``), each taken once and then set to None."""

    def __getitem__(self, number: int) -> Any: ...

    def __setitem__(self, number: int, value: None) -> None: ...


def grid_of(shape: tuple[int, ...], pieces: Sequence[PieceEntry]) -> slices.Grid | None:
    """The cut points per axis and each piece's cell (C order) when ``pieces`` are exactly
    the cells of a grid over ``shape``; None otherwise (those pieces stay inline)."""
    return slices.grid(tuple(shape), tuple(p.slice for p in pieces))


def _grid_rows(leaf: LeafEntry, file_index: dict[str, int]) -> tuple[Sequence[Any], np.ndarray] | None:
    """A leaf's cut points and table rows (in cell order) when its pieces form a grid."""
    grid = grid_of(leaf.shape, leaf.pieces)
    if grid is None:
        return None
    cuts, cells = grid
    rows = np.zeros(len(cells), ROW)
    order = np.argsort(np.asarray(cells, dtype=np.int64), kind="stable")
    ordered = [leaf.pieces[i] for i in order]
    rows["offset"] = [p.offset for p in ordered]
    rows["file"] = [file_index[p.file] for p in ordered]
    rows["crc32c"] = [p.crc32c for p in ordered]
    return cuts, rows


def _axis_json(cuts: Sequence[int] | np.ndarray, dim: int) -> int | list[int]:
    """An axis's cut points as the manifest holds them: the step when they are evenly spaced
    from 0 (the last cell may be shorter: JAX's uneven shardings), else the list."""
    points = np.asarray(cuts, dtype=np.int64)
    step = int(points[1] - points[0])
    even = points[-1] == dim and np.array_equal(points[:-1], np.arange(0, dim, step))
    return step if even else points.tolist()


def encode_manifest(
    manifest: Manifest, grids: GridSource | None = None, table_prefix: str = ""
) -> tuple[bytes, dict[str, bytes]]:
    """The sealed format 2 manifest of ``manifest``, and its piece tables by file name (the
    twin of ``decode_manifest``): the tables go first, the manifest (the commit) last. Leaves
    whose pieces form a grid keep their pieces in a table; the others (rare) keep them inline.
    ``grids``: per leaf, its cut points and rows (``ROW``, in cell order) when the caller has
    them already (the leader's merge of binary indexes); such a leaf's ``pieces`` are unused.
    ``grids`` is emptied as it goes: each leaf's grid goes once copied into its table.
    ``table_prefix`` starts the tables' names (a save's token: FORMAT.md, "File names").
    Each leaf's entry becomes JSON text at once: the entries as dicts (~0.7 KB each) would all
    be alive at the commit's peak, tens of MB for a state of many small leaves."""
    parts, tables = _unsealed(manifest, grids, table_prefix)
    return b"".join(sealed_parts(parts)), tables


def _unsealed(manifest: Manifest, grids: GridSource | None, table_prefix: str) -> tuple[list[Any], dict[str, bytes]]:
    """:func:`encode_manifest`'s manifest as buffers, neither joined nor sealed (one copy of
    the leaves' entries: a list of them, joined, would be two), and its tables. The entries
    go in chunks of about ``_CHUNK`` bytes: one growing buffer is copied as it grows, so a
    manifest of many leaves was briefly twice its size."""
    file_index = {name: i for i, name in enumerate(manifest.files)}
    tables: list[bytearray] = []
    chunks = [bytearray()]
    for number, leaf in enumerate(manifest.leaves):
        given = grids[number] if grids is not None else None
        if grids is not None:
            grids[number] = None
        grid = given if given is not None else _grid_rows(leaf, file_index) if leaf.kind == "array" else None
        doc = leaf_to_json(leaf, file_index, pieces=grid is None)
        if grid is not None:
            cuts, rows = grid
            data = np.ascontiguousarray(rows).data
            if not tables or len(tables[-1]) + data.nbytes > MAX_TABLE_ROWS * ROW_BYTES:
                tables.append(bytearray())
            doc["grid"] = [_axis_json(c, n) for c, n in zip(cuts, leaf.shape)]
            doc["table"] = [len(tables) - 1, len(tables[-1]) // ROW_BYTES, len(rows), crc32c(data)]
            tables[-1] += data
        if len(chunks[-1]) >= _CHUNK:
            chunks.append(bytearray())
        chunks[-1] += json.dumps(doc, separators=_COMPACT).encode()
        chunks[-1] += b","
    names = [table_file(i, table_prefix) for i in range(len(tables))]
    head = {
        "format": FORMAT_NAME,
        "format_version": version_for(manifest),
        "process_count": manifest.process_count,
        "sharding_callback": manifest.sharding_callback,
        "files": [[name, size] for name, size in manifest.files.items()],
        "tables": [[name, len(table)] for name, table in zip(names, tables)],
    }
    tail = {
        name: value for name, value in (("source", manifest.source), ("metrics", manifest.metrics)) if value is not None
    }
    end = "," + json.dumps(tail, separators=_COMPACT)[1:] if tail else "}"
    start = json.dumps(head, separators=_COMPACT)[:-1] + ',"leaves":['
    entries = [*chunks[:-1], memoryview(chunks[-1])[:-1]]  # less the last comma
    return [start.encode(), *entries, ("]" + end).encode()], {n: bytes(t) for n, t in zip(names, tables)}


_COMPACT = (",", ":")
_CHUNK = 1 << 20


def write(
    store: Any, manifest: Manifest, manifest_file: str, check: Callable[[dict[str, int]], None] | None = None,
    grids: GridSource | None = None, table_prefix: str = "",
    commit: Callable[[str, bytes], None] | None = None,
) -> None:
    """Writes ``manifest``'s piece tables, then (once they are durable, and ``check`` of
    their sizes by name has passed) the manifest itself, with ``commit`` if given (a save's
    exclusive create) or as a plain write. ``grids``, ``table_prefix``: as ``encode_manifest``'s."""
    parts, tables = _unsealed(manifest, grids, table_prefix)
    for future in [store.write(name, [data]) for name, data in tables.items()]:
        future.result()
    if check is not None:
        check({name: len(data) for name, data in tables.items()})
    sealed = sealed_parts(parts)  # written as buffers: no second copy of a manifest of many leaves
    if commit is not None:
        commit(manifest_file, b"".join(sealed))
    else:
        store.write(manifest_file, sealed).result()


# -- reading ----------------------------------------------------------------------------


def lazy_pieces(
    decoder: Any, doc: dict[str, Any], field: str, key: str, shape: tuple[int, ...], itemsize: int,
    files: tuple[list[str], list[int]], tables: list[tuple[str, int]], source: TableSource | None,
) -> LazyPieces:
    """A table leaf's pieces, its manifest fields checked (the rows are checked on load)."""
    t, row, count, crc = decoder.array(doc.get("table"), f"{field}.table", 4)
    t = decoder.integer(t, f"{field}.table (table index)", len(tables) - 1)
    row = decoder.integer(row, f"{field}.table (row)")
    count = decoder.integer(count, f"{field}.table (count)")
    crc = decoder.integer(crc, f"{field}.table (crc32c)", 0xFFFFFFFF)
    raw = decoder.array(doc.get("grid"), f"{field}.grid", len(shape))
    grid: list[int | list[int]] = []
    cells = []
    for d, (axis, n) in enumerate(zip(raw, shape)):
        if type(axis) is int:  # a step: cuts 0, step, 2 step, ..., n (expanded on load)
            if not 1 <= axis <= n:
                raise decoder.fail(
                    f"{field}.grid[{d}]", f"must be a step in [1, {n}] or a list of cut points, got {_short(axis)}"
                )
            grid.append(axis)
            cells.append(-(-n // axis))
            continue
        cuts = [decoder.integer(c, f"{field}.grid[{d}]", n) for c in decoder.array(axis, f"{field}.grid[{d}]")]
        if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != n or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise decoder.fail(f"{field}.grid[{d}]", f"must rise strictly from 0 to {n}, got {_short(cuts)}")
        grid.append(cuts)
        cells.append(len(cuts) - 1)
    if count != math.prod(cells):
        raise decoder.fail(f"{field}.table (count)", f"is {count}, but the grid has {math.prod(cells)} cells")
    name, size = tables[t]
    if row + count > size // ROW_BYTES:
        raise decoder.fail(
            f"{field}.table", f"names rows {row}..{row + count - 1}, past the {size // ROW_BYTES} rows of {name}"
        )
    if math.prod(shape) * itemsize > MAX_INT:
        raise decoder.fail(f"{field}.shape", "holds more than 2^63 bytes")
    return LazyPieces(TableRef(key=key, table=name, size=size, row=row, count=count, crc=crc, grid=grid, shape=shape,
                           itemsize=itemsize, files=files, source=source))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
