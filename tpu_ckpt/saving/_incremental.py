"""Incremental saves: the pieces equal to the newest committed step's are not written again.

A ``CheckpointManager(incremental=True)`` keeps one :class:`Incremental` per process: what
each of this process's pieces was in the newest step it committed (where its bytes lie, and
how to tell the bytes did not change). A save then drops from its plan every piece whose
bytes are known equal, and its index names the earlier step's data file and byte range
instead, as ``../step_<n>/<file>`` (FORMAT.md, "References"): a reference always names the
step that holds the bytes, never a step that itself references them.

Equality is never decided by crc32c (32 bits: over millions of pieces per save, collisions
would come) but by a 128-bit fingerprint of each piece's bytes (``saving/_fingerprint.py``),
with the same leaf, slice and dtype: a ``jax.Array`` in an accelerator's memory is
fingerprinted there, so an unchanged piece is never copied to the host, and a host array
(or a CPU device's) by BLAKE2b. So a new ``jax.Array`` with the bytes of the last step's
(what ``optax.apply_updates`` returns for a frozen parameter) is referenced too. A
``jax.Array`` is immutable, so the same object as last time, not deleted, holds the same
bytes: on the host it is not hashed again (a weak reference tells, so the manager keeps no
old state alive). The fingerprints live in this object, in memory: a manager started
anew (a resumed run) writes its first save whole, and compares from there (FORMAT.md,
"References"). Each save logs (INFO) the bytes it wrote and those it referenced.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import jax

from tpu_ckpt import storage
from tpu_ckpt.format import Manifest, PieceEntry, PlannedPiece, SliceSpec, flatten
from tpu_ckpt.saving._fingerprint import fingerprints
from tpu_ckpt.saving._plan import SavePlan

logger = logging.getLogger(__name__)

_Key = tuple[str, SliceSpec]


@dataclasses.dataclass(frozen=True)
class _Known:
    """One piece of the last committed step: where its bytes are (a name relative to any
    step of the run), its data file's size, its dtype, and its sample and fingerprint
    (``saving/_fingerprint.py``; an empty fingerprint is unknown)."""

    entry: PieceEntry
    file_size: int
    dtype: str
    fingerprint: tuple[bytes, bytes]


@dataclasses.dataclass
class Reused:
    """The pieces a save does not write: per key, their entries (naming the earlier steps'
    files), and those files' sizes; ``nbytes`` is what was not written."""

    pieces: dict[str, list[PieceEntry]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    files: dict[str, int] = dataclasses.field(default_factory=dict)
    nbytes: int = 0


class Incremental:
    """What this process's pieces were in the newest step it committed (see module docstring)."""

    def __init__(self) -> None:
        self.step: storage.Location | None = None  # the newest committed step
        self._known: dict[_Key, _Known] = {}
        self._arrays: dict[str, weakref.ref] = {}  # key -> the jax.Array saved last time
        self._pending: tuple[dict[_Key, tuple[str, tuple[bytes, bytes]]], dict[str, weakref.ref], int] = ({}, {}, 0)

    def forget_unless(self, listed: Iterable[str]) -> None:
        """Forgets the pieces whose bytes lie in a step not among ``listed`` (the run's
        committed and retired steps: one deleted by other means, or by another manager's
        retention, holds no bytes to reference), with a warning naming it: the next save
        writes those pieces itself."""
        listed = set(listed)
        gone = {step for step in (_step_of(known.entry.file) for known in self._known.values()) if step not in listed}
        if gone:
            logger.warning(
                "tpu_ckpt: %s is gone, yet holds pieces the last save of this run references; the next "
                "save writes them itself", ", ".join(sorted(gone)),
            )
            self._known = {key: known for key, known in self._known.items() if _step_of(known.entry.file) not in gone}

    def forget(self) -> None:
        """Forgets every piece (after a failed save, whose references may name a step gone or
        damaged): the next save writes everything."""
        self.step, self._known, self._arrays = None, {}, {}

    def apply(self, plan: SavePlan, tree: Any, final: storage.Location) -> tuple[SavePlan, Reused]:
        """``plan`` less the pieces whose bytes the last step holds, and those pieces."""
        leaves = {key: leaf for key, _, leaf in flatten(tree, keep_none=True)[0]}
        dtypes = {leaf.key: leaf.dtype for leaf in plan.manifest.leaves}
        same_run = self.step is not None and _parent(self.step) == _parent(final)
        pieces = [piece for file in plan.files for piece in file.pieces]
        known = [self._known.get((piece.key, piece.slice)) if same_run else None for piece in pieces]
        prints = dict(zip(((p.key, p.slice) for p in pieces), self._fingerprints(pieces, known, leaves)))
        arrays = {key: weakref.ref(leaf) for key, leaf in leaves.items() if isinstance(leaf, jax.Array)}
        reused, files, last = Reused(), [], iter(known)
        for file in plan.files:
            kept: list[PlannedPiece] = []
            for piece in file.pieces:
                before = next(last)
                if before is not None and _same(before, dtypes[piece.key], prints[piece.key, piece.slice][1]):
                    reused.pieces[piece.key].append(before.entry._replace(slice=piece.slice))
                    reused.files[before.entry.file] = before.file_size
                    reused.nbytes += piece.nbytes
                else:
                    kept.append(piece)
            if kept:
                files.append(dataclasses.replace(file, pieces=tuple(kept), nbytes=sum(p.nbytes for p in kept)))
        self._pending = ({k: (dtypes[k[0]], p) for k, p in prints.items()}, arrays, reused.nbytes)
        return dataclasses.replace(plan, files=tuple(files)), reused

    def _fingerprints(
        self, pieces: list[PlannedPiece], known: list[_Known | None], leaves: dict[str, Any]
    ) -> list[tuple[bytes, bytes]]:
        """Each piece's sample and fingerprint (``saving/_fingerprint.py``): a jax.Array that
        is the same object as last time, not deleted, holds the same bytes."""
        unchanged = [
            before is not None and _unchanged(self._arrays.get(p.key), leaves.get(p.key))
            for p, before in zip(pieces, known)
        ]
        previous = [None if before is None else before.fingerprint for before in known]
        return fingerprints([piece.data for piece in pieces], previous, unchanged)

    def committed(self, final: storage.Location, own: Manifest) -> None:
        """The save of ``apply``'s plan committed as ``final`` with this process's index ``own``."""
        prints, arrays, referenced = self._pending
        self._pending = ({}, {}, 0)
        name = _name(final)
        known: dict[_Key, _Known] = {}
        for leaf in own.leaves:
            for entry in leaf.pieces:
                dtype, fingerprint = prints.get((leaf.key, entry.slice), ("", (b"", b"")))
                file = entry.file if entry.file.startswith("../") else f"../{name}/{entry.file}"
                piece = entry._replace(file=file)
                known[leaf.key, entry.slice] = _Known(piece, own.files[entry.file], dtype, fingerprint)
        self.step, self._known, self._arrays = final, known, arrays
        written = sum(size for file, size in own.files.items() if not file.startswith("../"))
        logger.info(
            "tpu_ckpt: incremental save %s: wrote %d bytes (data files), referenced %d bytes of earlier steps",
            final.url, written, referenced,
        )


def _step_of(reference: str) -> str:
    """The step a known piece's file lies in: ``step_<n>`` of ``../step_<n>/<file>``."""
    return reference.split("/", 2)[1]


def _unchanged(ref: weakref.ref | None, leaf: Any) -> bool:
    """Whether ``leaf`` is the jax.Array ``ref`` names, not deleted (so its bytes are the same)."""
    return isinstance(leaf, jax.Array) and not leaf.is_deleted() and ref is not None and ref() is leaf


def _same(before: _Known, dtype: str, fingerprint: bytes) -> bool:
    """Whether a piece of ``dtype`` and ``fingerprint`` holds ``before``'s bytes (an unknown,
    empty, fingerprint is never the same)."""
    return bool(fingerprint) and (before.dtype, before.fingerprint[1]) == (dtype, fingerprint)


def _name(loc: storage.Location) -> str:
    return loc.url.rstrip("/").rsplit("/", 1)[-1]


def _parent(loc: storage.Location) -> str:
    return loc.url.rstrip("/").rsplit("/", 1)[0]
