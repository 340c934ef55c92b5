"""verify(): read every byte of a checkpoint and report everything that is wrong with it.

A restore stops at the first bad piece; a verifier is asked "is this checkpoint sound, and if not, what exactly is
broken", so it collects every problem: an uncommitted, unreadable or inconsistent manifest (the checks of
``format/_decode.py``, exactly those a restore makes), missing and truncated data files, and every piece whose crc32c
does not match. Reads go through storage.Store in coalesced ranges (as a restore's), a bounded number of bytes in
flight, with the checksums computed in the IO threads so they run in parallel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import posixpath
from collections.abc import Callable, Iterator

import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.catalog._open import OpenCheckpoint, open_checkpoint
from tpu_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UncommittedCheckpointError,
)
from tpu_ckpt.format import (
    Manifest,
    PieceEntry,
    Read,
    check_byte_ranges,
    coalesce,
    crc32c,
    tensor_name,
)
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

_KEYS_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, with the file (or checkpoint) and keys it concerns."""

    kind: str  # uncommitted | manifest | missing | truncated | unreadable | crc32c
    where: str
    keys: tuple[str, ...] = ()
    detail: str = ""

    def __str__(self) -> str:
        text = f"{self.kind}: {self.where}"
        if self.keys:
            shown = ", ".join(self.keys[:_KEYS_SHOWN])
            more = f" and {len(self.keys) - _KEYS_SHOWN} more" if len(self.keys) > _KEYS_SHOWN else ""
            text += f" (key{'s' if len(self.keys) > 1 else ''} {shown}{more})"
        return f"{text}: {self.detail}" if self.detail else text


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`verify` checked and found."""

    path: str
    leaves: int
    pieces: int
    nbytes: int
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    path: str | os.PathLike[str], *, progress: Callable[[int, int], None] | None = None, threads: int | None = None
) -> Report:
    """Checks the checkpoint at ``path``: manifest, data files, every piece's crc32c.

    ``progress(done, total)`` is called with byte counts as pieces are checked. Problems are
    returned in the report, never raised; only a path holding nothing at all raises
    (CheckpointNotFoundError), as does an unsupported URL (ValueError).
    """
    loc = storage.location(path)
    try:
        checkpoint = open_checkpoint(loc, threads=threads)
    except CheckpointError as e:
        if type(e) is CheckpointNotFoundError and e.file == loc.url:
            raise
        return Report(loc.url, 0, 0, 0, [_manifest_problem(loc, e)])
    with checkpoint:
        return _verified(checkpoint, progress)


def _verified(checkpoint: OpenCheckpoint[storage.Backend], progress: Callable[[int, int], None] | None) -> Report:
    loc, manifest = checkpoint.location, checkpoint.manifest
    try:
        checkpoint.load_all()
        # Format 2: every leaf's rows, each run against its crc32c, then every piece's bytes
        # against every other's (a restore of some leaves checks only theirs).
        check_byte_ranges(manifest, checkpoint.where)
    except CheckpointError as e:
        return Report(loc.url, 0, 0, 0, [_manifest_problem(loc, e)])
    problems: list[Problem] = []
    pieces = [(leaf.key, p) for leaf in manifest.leaves for p in leaf.pieces]
    absent = _missing_files(checkpoint.store, manifest)
    problems += [
        Problem("missing", loc.child(file), _keys_in(pieces, file), "data file does not exist")
        for file in sorted(absent)
    ]
    reads = coalesce((key, p) for key, p in pieces if p.file not in absent)
    problems += _check_pieces(checkpoint.store, reads, progress)
    nbytes = sum(p.length for _, p in pieces)
    logger.info("tpu_ckpt: verified %s: %d pieces, %d problems", loc.url, len(pieces), len(problems))
    return Report(loc.url, len(manifest.leaves), len(pieces), nbytes, problems)


def _manifest_problem(loc: storage.Location, error: CheckpointError) -> Problem:
    kind = "uncommitted" if isinstance(error, UncommittedCheckpointError) else "manifest"
    return Problem(kind, error.file or loc.url, detail=str(error))


def _missing_files(store: storage.Backend, manifest: Manifest) -> set[str]:
    """The manifest's data files that are not stored. A linked checkpoint's live in another
    directory (``../step_100/...``): each directory is listed once (its own, through its store)."""
    loc = store.location
    by_dir: dict[str, list[str]] = collections.defaultdict(list)
    for name in manifest.files:
        by_dir[posixpath.dirname(name)].append(name)
    missing: set[str] = set()
    for directory, names in by_dir.items():
        if not directory:
            present = set(store.list())
        else:
            beside = directory.startswith("../")  # a sibling step's, or a linked checkpoint's source
            where = loc.sibling(directory[3:]) if beside else storage.Location(loc.child(directory))
            with storage.Store(where, threads=1) as other:
                present = set(other.list())
        missing.update(n for n in names if posixpath.basename(n) not in present)
    return missing


def _keys_in(pieces: list[tuple[str, PieceEntry]], file: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(key for key, p in pieces if p.file == file))


class _Mismatch(Exception):
    """Raised in an IO thread for the pieces of one read whose crc32c is wrong; their bytes
    are dropped right there, so a corrupt checkpoint costs no more memory than a sound one."""

    def __init__(self, pieces: list[tuple[str, PieceEntry]]):
        super().__init__(pieces)
        self.pieces = pieces


def _check_crcs(read: Read, chunks: list[np.ndarray]) -> None:
    bad = [(key, p) for (key, p), chunk in zip(read.pieces, read.piece_chunks(chunks)) if crc32c(chunk) != p.crc32c]
    if bad:
        raise _Mismatch(bad)


def _start(store: storage.CheckpointStore, read: Read) -> concurrent.futures.Future:
    return store.read(read.file, read.start, read.lengths(), then=functools.partial(_check_crcs, read))


def _nbytes(read: Read) -> int:
    return read.stop - read.start


def _check_pieces(
    store: storage.CheckpointStore, reads: list[Read], progress: Callable[[int, int], None] | None
) -> list[Problem]:
    total, done = sum(map(_nbytes, reads)), 0
    problems: list[Problem] = []
    for read, future in _pipelined(store, reads):
        problems += _outcome(store, read, future)
        done += _nbytes(read)
        if progress is not None:
            progress(done, total)
    return _merged(problems)


def _pipelined(
    store: storage.CheckpointStore, reads: list[Read]
) -> Iterator[tuple[Read, concurrent.futures.Future]]:
    """Yields the reads in order, keeping up to ``read_batch_bytes`` (a setting; at least one
    read) started."""
    in_flight: collections.deque = collections.deque()
    nbytes = 0
    for read in reads:
        in_flight.append((read, _start(store, read)))
        nbytes += _nbytes(read)
        while nbytes >= settings().read_batch_bytes:
            oldest = in_flight.popleft()
            nbytes -= _nbytes(oldest[0])
            yield oldest
    yield from in_flight


def _outcome(store: storage.CheckpointStore, read: Read, future: concurrent.futures.Future) -> list[Problem]:
    try:
        future.result()
    except _Mismatch as e:
        return [_crc_problem(store, key, p) for key, p in e.pieces]
    except (CheckpointError, OSError):
        return _per_piece(store, read)
    return []


def _per_piece(store: storage.CheckpointStore, read: Read) -> list[Problem]:
    """A coalesced read failed (a short file, an object store that gave up): re-read its
    pieces one by one to name exactly the ones affected."""
    problems = []
    for key, p in read.pieces:
        try:
            _start(store, Read.of(key, p)).result()
        except _Mismatch:
            problems.append(_crc_problem(store, key, p))
        except CorruptCheckpointError as e:
            if "truncated" in str(e):
                where = store.location.child(p.file)
                problems.append(Problem("truncated", where, (key,), "the file ends before its pieces do"))
            else:  # not a regular file, a link out of the checkpoint: its own words say what it is
                problems.append(Problem("unreadable", store.location.child(p.file), (key,), str(e)))
        except (CheckpointError, OSError) as e:
            problems.append(Problem("unreadable", store.location.child(p.file), (key,), str(e)))
    return problems


def _crc_problem(store: storage.CheckpointStore, key: str, piece: PieceEntry) -> Problem:
    where = store.location.child(piece.file)
    return Problem("crc32c", where, (key,), f"piece {tensor_name('', piece.slice)} does not match its crc32c")


def _merged(problems: list[Problem]) -> list[Problem]:
    """Truncated and unreadable pieces as one problem per file and cause, naming every key."""
    out = [p for p in problems if p.kind == "crc32c"]
    merged: dict[tuple[str, str, str], list[str]] = {}
    for p in problems:
        if p.kind != "crc32c":
            merged.setdefault((p.kind, p.where, p.detail), []).extend(p.keys)
    out += [Problem(kind, where, tuple(dict.fromkeys(keys)), detail) for (kind, where, detail), keys in merged.items()]
    return out
