"""Read planning (pure, no IO): which byte ranges a restore must read.

For each wanted global slice we find the pieces that overlap it; pieces are always read
whole, so every byte that reaches the user has been checked against its crc32c. Pieces that
sit back to back in one data file are fetched with one ranged read (scattered into one
buffer per piece, so each piece stays aligned for a zero-copy transfer to its device).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import _slices as slices
from tpu_ckpt.format._manifest import ALIGNMENT, LeafEntry, PieceEntry, crc32c

if TYPE_CHECKING:  # annotations only: planning reads needs no JAX
    from tpu_ckpt.format._slices import SliceSpec

T = TypeVar("T")

MAX_READ_BYTES = 64 << 20  # bigger single reads cost parallelism and gain nothing


@dataclasses.dataclass(frozen=True)
class Read:
    """One ranged read of ``[start, stop)`` of ``file``, serving ``pieces`` (in file order,
    perhaps with alignment padding between them)."""

    file: str
    start: int
    stop: int
    pieces: tuple[tuple[str, PieceEntry], ...]  # (leaf key, piece)

    @classmethod
    def of(cls, key: str, piece: PieceEntry) -> Read:
        """The read of one piece alone (checked against its crc32c like any other)."""
        return cls(piece.file, piece.offset, piece.offset + piece.length, ((key, piece),))

    def lengths(self) -> list[int]:
        """The consecutive byte counts that make up the read: each piece, and each gap."""
        out, at = [], self.start
        for _, piece in self.pieces:
            if piece.offset > at:
                out.append(piece.offset - at)
            out.append(piece.length)
            at = piece.offset + piece.length
        return out

    def piece_chunks(self, chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The pieces' bytes among the chunks a read of :meth:`lengths` returned."""
        if len(chunks) == len(self.pieces):
            return list(chunks)
        out, at, i = [], self.start, 0
        for _, piece in self.pieces:
            if piece.offset > at:
                i += 1  # padding
            out.append(chunks[i])
            i += 1
            at = piece.offset + piece.length
        return out


def overlapping(leaf: LeafEntry, want: SliceSpec) -> list[PieceEntry]:
    """The pieces of ``leaf`` that hold any element of ``want``."""
    if not want:  # a scalar: its single piece
        return list(leaf.pieces[:1])
    exact = leaf.piece_at.get(want)
    if exact is not None:
        return [exact]
    rows, (lo, hi) = leaf.rows, want[0]
    last = bisect.bisect_left(rows.starts, hi)  # groups starting before ``want`` ends
    first = bisect.bisect_right(rows.stops, lo) if rows.disjoint else 0  # ...and ending after it starts
    return [
        p for group in rows.groups[first:last] for p in group if slices.intersect(p.slice, want) is not None
    ]


def check_crcs(where: str, read: Read, chunks: Sequence[np.ndarray]) -> None:
    """Raises CorruptCheckpointError naming the key and file if a piece's bytes do not match
    its crc32c; ``where`` is the data file's path or URL."""
    for (key, piece), chunk in zip(read.pieces, read.piece_chunks(chunks)):
        if crc32c(chunk) != piece.crc32c:
            raise CorruptCheckpointError(
                f"crc32c mismatch for key {key!r} slice {list(piece.slice)} in {where}: the file is corrupt",
                key=key, file=where,
            )


def byte_batches(items: Iterable[T], nbytes: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive items whose bytes add up to at most ``limit``; an item larger than that alone.
    What a restore, an export and an Orbax import each hold in memory at once."""
    out: list[list[T]] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if not out or (out[-1] and size + n > limit):
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out


def coalesce(needed: Iterable[tuple[str, PieceEntry]]) -> list[Read]:
    """Merges pieces adjacent in one file into ranged reads; each piece appears once."""
    unique = {(p.file, p.offset): (key, p) for key, p in needed if p.length > 0}
    by_file: dict[str, list[tuple[str, PieceEntry]]] = {}
    for key, piece in sorted(unique.values(), key=lambda kp: (kp[1].file, kp[1].offset)):
        by_file.setdefault(piece.file, []).append((key, piece))
    reads: list[Read] = []
    for file, pieces in by_file.items():
        group: list[tuple[str, PieceEntry]] = []
        for key, piece in pieces:
            if group and not _joinable(group, piece):
                reads.append(_read(file, group))
                group = []
            group.append((key, piece))
        if group:
            reads.append(_read(file, group))
    return reads


def _joinable(group: Sequence[tuple[str, PieceEntry]], piece: PieceEntry) -> bool:
    """Whether ``piece`` follows the group in its file, at most alignment padding apart."""
    start = group[0][1].offset
    end = group[-1][1].offset + group[-1][1].length
    return 0 <= piece.offset - end < ALIGNMENT and piece.offset + piece.length - start <= MAX_READ_BYTES


def _read(file: str, group: Sequence[tuple[str, PieceEntry]]) -> Read:
    start = group[0][1].offset
    stop = max(p.offset + p.length for _, p in group)
    return Read(file, start, stop, tuple(group))
