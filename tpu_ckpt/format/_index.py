"""A process's index as binary rows: where each piece it wrote landed, for the leader's commit.

Every process but the leader leaves one in the staging area (``index-<p>.bin``); the leader
reads them all, merges them with array operations and writes the piece tables: at 1,536
hosts and 13.5 M pieces a Python object per piece (the JSON index of format 1) costs
minutes and gigabytes on one host, numpy rows cost seconds. An index is staging-only: the
commit deletes it, and no committed checkpoint holds one (FORMAT.md, "Per-process index").

Layout (little-endian): 8 bytes of magic, the header's length (u32), the crc32c of
everything after these 16 bytes (u32), the header (compact JSON: the tree's digest and leaf
count, the process's data files, and per rank its number of rows), then the rows of each
rank, back to back. A row (``row_dtype``) is the piece's leaf (its number among the plan's
leaves, which every process plans alike), data file (an index into the header's files),
offset, length and crc32c, then its slice's starts and stops. Rows are sorted by leaf, then
slice, so the leader's merge sorts runs that are already in order.

Nothing in an index is used before it is checked (``decode_index``): a damaged or hostile
one is a :class:`CorruptCheckpointError` naming the file and what is wrong, and one of
another tree a :class:`CheckpointError`; no commit follows either.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import _decode_layout as decode_layout
from tpu_ckpt.format._manifest import MAX_INT, LeafEntry, Manifest, PieceEntry, crc32c, dtype_itemsize

MAGIC = b"TPUCKIX1"
_PREFIX = struct.Struct("<8sII")  # magic, header length, crc32c of the rest
INDEX_FORMAT = "tpu_ckpt index"
INDEX_VERSION = 1
MAX_RANK = 64


@functools.cache
def row_dtype(rank: int) -> np.dtype:
    """One piece of a leaf of ``rank`` dimensions, as an index holds it."""
    return np.dtype([("leaf", "<u4"), ("file", "<u4"), ("offset", "<u8"), ("length", "<u8"), ("crc32c", "<u4"),
                     ("start", "<i8", (rank,)), ("stop", "<i8", (rank,))])


@dataclasses.dataclass(frozen=True)
class IndexPlan:
    """What every process knows of the tree before writing: its leaves' keys (a piece names
    its leaf by number), shapes and item sizes, which the rows are checked against."""

    keys: tuple[str, ...]
    digest: int  # crc32c of the keys: an index of another tree is refused
    ranks: np.ndarray  # per leaf; -1 for a value leaf
    dims: np.ndarray  # [leaf, axis], 0 past a leaf's rank
    itemsizes: np.ndarray

    @staticmethod
    def of(planned: Manifest) -> IndexPlan:
        keys = tuple(leaf.key for leaf in planned.leaves)
        arrays = [leaf.kind == "array" for leaf in planned.leaves]
        ranks = np.array([len(leaf.shape) if a else -1 for leaf, a in zip(planned.leaves, arrays)], np.int64)
        dims = np.zeros((len(keys), max(int(ranks.max(initial=0)), 1)), np.int64)
        for n, leaf in enumerate(planned.leaves):
            dims[n, : len(leaf.shape)] = leaf.shape
        itemsizes = np.array(
            [dtype_itemsize(leaf.dtype) if a else 0 for leaf, a in zip(planned.leaves, arrays)], np.int64
        )
        digest = crc32c(json.dumps(keys).encode())
        return IndexPlan(keys, digest, ranks, dims, itemsizes)

    @functools.cached_property
    def numbers(self) -> dict[str, int]:
        return {key: n for n, key in enumerate(self.keys)}


@dataclasses.dataclass
class IndexRows:
    """One process's index, decoded and checked: its data files and its rows per rank
    (views of the file's bytes)."""

    where: str
    names: list[str]
    sizes: np.ndarray
    groups: dict[int, np.ndarray]


def encode_index(index: Manifest, plan: IndexPlan) -> bytes:
    """``index`` (a process's pieces and data files, ``saving.index``) as binary rows."""
    names = list(index.files)
    number_of_file = {name: i for i, name in enumerate(names)}
    by_rank: dict[int, list[tuple[Any, ...]]] = {}
    for leaf in index.leaves:
        number = _number(plan, leaf.key)
        for p in leaf.pieces:
            row = (number, number_of_file[p.file], p.offset, p.length, p.crc32c, p.slice)
            by_rank.setdefault(len(p.slice), []).append(row)
    return encode_rows(plan, list(index.files.items()), {rank: _rows(rank, by_rank[rank]) for rank in by_rank})


def piece_rows(plan: IndexPlan, file: int, keys: Sequence[str], pieces: Sequence[PieceEntry]) -> dict[int, np.ndarray]:
    """The pieces of one data file (number ``file``; ``keys``: each one's leaf) as index rows
    per rank: a save keeps its index as these, a few bytes a piece, not as objects."""
    by_rank: dict[int, list[tuple[Any, ...]]] = {}
    for key, p in zip(keys, pieces):
        by_rank.setdefault(len(p.slice), []).append((_number(plan, key), file, p.offset, p.length, p.crc32c, p.slice))
    return {rank: _rows(rank, items) for rank, items in by_rank.items()}


def encode_parts(plan: IndexPlan, files: Sequence[tuple[str, int]], parts: Sequence[dict[int, np.ndarray]]) -> bytes:
    """The index of ``files`` whose rows were made a file at a time (``piece_rows``): the
    bytes :func:`encode_index` writes for the same pieces."""
    groups = {}
    for rank in sorted({rank for part in parts for rank in part}):
        rows = np.concatenate([part[rank] for part in parts if rank in part])
        groups[rank] = rows[sort_order(rows["leaf"], rows["start"])]
    return encode_rows(plan, files, groups)


def _number(plan: IndexPlan, key: str) -> int:
    number = plan.numbers.get(key)
    if number is None:
        raise CheckpointError(
            f"Key {key!r} was written but is not in the planned tree; are all processes saving the same tree?", key=key
        )
    return number


def encode_rows(plan: IndexPlan, files: Sequence[tuple[str, int]], groups: dict[int, np.ndarray]) -> bytes:
    """An index of ``files`` and ``groups`` (rank -> rows, ``row_dtype(rank)``): what
    :func:`encode_index` writes, or a part of one (a local tier's part, cut by leaves)."""
    ranks = sorted(groups)
    header = json.dumps({
        "format": INDEX_FORMAT, "version": INDEX_VERSION, "tree": plan.digest, "leaves": len(plan.keys),
        "files": [[name, size] for name, size in files],
        "groups": [[rank, len(groups[rank])] for rank in ranks],
    }, separators=(",", ":")).encode()
    body = b"".join([header, *(np.ascontiguousarray(groups[rank]).tobytes() for rank in ranks)])
    return _PREFIX.pack(MAGIC, len(header), crc32c(body)) + body


def index_manifest(rows: IndexRows, plan: IndexPlan) -> Manifest:
    """``rows`` back in manifest form (``saving.index``'s, the inverse of ``encode_index``):
    a Python object per piece, so for one process's own part (a local step's upload), never
    the job's pieces on one host."""
    pieces: dict[int, list[PieceEntry]] = {}
    for group in rows.groups.values():
        spans = np.stack([group["start"], group["stop"]], axis=-1).tolist()  # [row][axis][start, stop]
        columns = zip(*(group[field].tolist() for field in ("leaf", "file", "offset", "length", "crc32c")))
        for (leaf, file, offset, length, crc), span in zip(columns, spans):
            piece = PieceEntry(tuple(map(tuple, span)), rows.names[file], offset, length, crc)
            pieces.setdefault(leaf, []).append(piece)
    leaves = tuple(LeafEntry(plan.keys[n], [], "array", pieces=tuple(p)) for n, p in sorted(pieces.items()))
    return Manifest(leaves, dict(zip(rows.names, rows.sizes.tolist())), 0, "")


def _rows(rank: int, items: list[tuple[Any, ...]]) -> np.ndarray:
    rows = np.zeros(len(items), row_dtype(rank))
    leaf, file, offset, length, crc, spec = zip(*items)
    rows["leaf"], rows["file"], rows["offset"], rows["length"], rows["crc32c"] = leaf, file, offset, length, crc
    bounds = np.array(spec, dtype=np.int64).reshape(len(items), rank, 2)
    rows["start"], rows["stop"] = bounds[:, :, 0], bounds[:, :, 1]
    return rows[sort_order(rows["leaf"], rows["start"])]


def sort_order(leaf: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The order of rows by leaf, then slice start (C order of a grid's cells): one stable
    sort of a packed key where the numbers fit in 63 bits (they do for any real shape), else
    a lexicographic sort."""
    columns = [leaf.astype(np.int64), *(start[:, d] for d in range(start.shape[1]))]
    bits = [int(c.max(initial=0)).bit_length() for c in columns]
    if sum(bits) > 63 or any(int(c.min(initial=0)) < 0 for c in columns):
        return np.lexsort(columns[::-1])
    key = np.zeros(len(leaf), np.int64)
    for column, width in zip(columns, bits):
        key <<= width
        key |= column
    return np.argsort(key, kind="stable")


def decode_index(data: bytes, *, where: str, plan: IndexPlan) -> IndexRows:
    """The index in ``data`` (the bytes of ``where``), every row checked against ``plan``."""
    if len(data) < _PREFIX.size or data[:8] != MAGIC:
        raise _corrupt(where, f"is not a tpu_ckpt index ({len(data)} bytes, without its magic)")
    _, length, crc = _PREFIX.unpack_from(data)
    if length > len(data) - _PREFIX.size:
        raise _corrupt(where, f"gives its header {length} bytes, past the file's {len(data)}")
    if crc32c(memoryview(data)[_PREFIX.size :]) != crc:
        raise _corrupt(where, "does not match its crc32c")
    names, sizes, counts = _header(data[_PREFIX.size : _PREFIX.size + length], where, plan)
    offset = _PREFIX.size + length
    expected = offset + sum(count * row_dtype(rank).itemsize for rank, count in counts)
    if expected != len(data):
        raise _corrupt(where, f"is {len(data)} bytes, and its header says {expected}")
    groups = {}
    for rank, count in counts:
        groups[rank] = np.frombuffer(data, row_dtype(rank), count, offset)
        offset += count * row_dtype(rank).itemsize
        _check_rows(groups[rank], rank, sizes, plan, where)
    _check_disjoint(list(groups.values()), names, where)
    return IndexRows(where, names, sizes, groups)


def _header(text: bytes, where: str, plan: IndexPlan) -> tuple[list[str], np.ndarray, list[tuple[int, int]]]:
    """The header's data files (names, sizes) and rows per rank, each field checked."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise _corrupt(where, "has a header that is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or doc.get("version") != INDEX_VERSION:
        raise _corrupt(where, f"has a header of no index format this tpu_ckpt reads (format {INDEX_VERSION})")
    if doc.get("tree") != plan.digest or doc.get("leaves") != len(plan.keys):
        raise CheckpointError(
            f"{where}: this process's index is of another tree ({_short(doc.get('leaves'))} leaves) than the "
            f"leader's plan ({len(plan.keys)} leaves); refusing to commit. Are all processes saving the same tree?",
            file=where,
        )
    files = _pairs(doc.get("files"), "files", where)
    names = [name for name, _ in files]
    for name in names:
        problem = (
            "is not a string" if type(name) is not str
            else decode_layout._file_name_problem(name, None, references=True)
        )
        if problem is None and names.count(name) > 1:
            problem = "is listed twice"
        if problem is not None:
            raise _corrupt(where, f"names data file {_short(name)}, which {problem}")
    sizes = [size for _, size in files]
    if any(type(s) is not int or not 0 <= s <= MAX_INT for s in sizes):
        raise _corrupt(where, "gives a data file a size that is not an integer in [0, 2^63)")
    counts = _pairs(doc.get("groups"), "groups", where)
    ranks = [rank for rank, _ in counts]
    bad_count = any(type(v) is not int or not 0 <= v <= MAX_INT for pair in counts for v in pair)
    if bad_count or max(ranks, default=0) > MAX_RANK:
        raise _corrupt(where, f"has a group of rows whose rank is outside [0, {MAX_RANK}] or whose count is no integer")
    if ranks != sorted(set(ranks)):
        raise _corrupt(where, "does not list its groups of rows by rising rank, once each")
    return names, np.array(sizes, np.uint64), counts


def _pairs(value: Any, field: str, where: str) -> list[tuple[Any, Any]]:
    if type(value) is not list or any(type(item) is not list or len(item) != 2 for item in value):
        raise _corrupt(where, f"has a header whose field {field} is not a list of pairs")
    return [(a, b) for a, b in value]


def _check_rows(rows: np.ndarray, rank: int, sizes: np.ndarray, plan: IndexPlan, where: str) -> None:
    """Each row names a leaf of this rank and one of the index's files, and its slice and
    bytes lie inside the leaf and the file, its length that of its slice."""
    leaf = rows["leaf"].astype(np.int64)
    _first_bad(leaf >= len(plan.keys), rows, where, f"names a leaf past the tree's {len(plan.keys)}")
    other_rank = f"gives a slice of {rank} dimensions to a leaf of another rank"
    _first_bad(plan.ranks[leaf] != rank, rows, where, other_rank, plan)
    _first_bad(rows["file"] >= len(sizes), rows, where, f"names a data file past the index's {len(sizes)}", plan)
    offset, length = rows["offset"], rows["length"]
    _first_bad((offset > MAX_INT) | (length > MAX_INT), rows, where, "holds an offset or length past 2^63", plan)
    start, stop = rows["start"], rows["stop"]
    outside = (start < 0) | (start > stop) | (stop > plan.dims[leaf, :rank])
    _first_bad(outside.any(axis=1), rows, where, "holds a slice outside the leaf's shape", plan)
    volume = np.prod(stop - start, axis=1) * plan.itemsizes[leaf]
    _first_bad(volume != length.astype(np.int64), rows, where, "holds a length other than the slice's bytes", plan)
    _first_bad((length == 0) & (rows["crc32c"] != 0), rows, where, "holds an empty piece with a non-zero crc32c", plan)
    _first_bad(offset + length > sizes[rows["file"]], rows, where, "places bytes past the end of its data file", plan)


def _first_bad(bad: Any, rows: np.ndarray, where: str, problem: str, plan: IndexPlan | None = None) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        key = plan.keys[int(rows["leaf"][i])] if plan is not None else None
        about = f" (key {key!r})" if key is not None else ""
        raise CorruptCheckpointError(
            f"{where}: row {i}{about} {problem} (the first of {int(bad.sum())} such rows); the index is damaged, "
            "so the save cannot commit: save again.",
            key=key, file=where,
        )


def _check_disjoint(groups: Sequence[np.ndarray], names: list[str], where: str) -> None:
    """No two pieces share a byte of a data file (each is checked against its own crc32c)."""
    if not groups:
        return
    file, offset, length = (
        np.concatenate([g[field] for g in groups]).astype(np.int64) for field in ("file", "offset", "length")
    )
    keep = length > 0
    file, offset, length = file[keep], offset[keep], length[keep]
    order = np.lexsort((offset, file))
    f, o, n = file[order], offset[order], length[order]
    clash = (f[1:] == f[:-1]) & (o[:-1] + n[:-1] > o[1:])
    if clash.any():
        raise _corrupt(where, f"gives two pieces overlapping bytes of {names[int(f[int(np.argmax(clash))])]}")


def _corrupt(where: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} {problem}: the index is damaged, so the save cannot commit; save again.", file=where
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
