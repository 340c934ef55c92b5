"""Incremental saves: the pieces equal to the newest committed step's are not written again.

A ``CheckpointManager(incremental=True)`` keeps one :class:`Incremental` per process: what
each of this process's pieces was in the newest step it committed (where its bytes lie, and
how to tell the bytes did not change). A save then drops from its plan every piece whose
bytes are known equal, and its index names the earlier step's data file and byte range
instead, as ``../step_<n>/<file>`` (FORMAT.md, "References"): a reference always names the
step that holds the bytes, never a step that itself references them.

Equality is never decided by crc32c (32 bits: over millions of pieces per save, collisions
would come). A ``jax.Array`` is immutable, so the same object as last time, not deleted,
holds the same bytes: it is compared by identity (a weak reference, so the manager keeps no
old state alive) and not even copied to the host. A host array can be changed in place, so
it is compared by a 128-bit BLAKE2b digest of its bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import weakref
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.format import Manifest, PieceEntry, PlannedPiece, SliceSpec, flatten
from tpu_ckpt.saving._plan import SavePlan

_Key = tuple[str, SliceSpec]


@dataclasses.dataclass(frozen=True)
class _Known:
    """One piece of the last committed step: where its bytes are (a name relative to any
    step of the run), its data file's size, and its digest (None: compared by identity)."""

    entry: PieceEntry
    file_size: int
    dtype: str
    digest: bytes | None


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
        self._pending: tuple[dict[_Key, tuple[str, bytes | None]], dict[str, weakref.ref]] = ({}, {})

    def forget_unless(self, committed: Iterable[str]) -> None:
        """Forgets the last step unless its name is among ``committed`` (deleted by other
        means, it holds no bytes to reference): the next save then writes everything."""
        if self.step is not None and _name(self.step) not in set(committed):
            self.step, self._known, self._arrays = None, {}, {}

    def apply(self, plan: SavePlan, tree: Any, final: storage.Location) -> tuple[SavePlan, Reused]:
        """``plan`` less the pieces whose bytes the last step holds, and those pieces."""
        leaves = {key: leaf for key, _, leaf in flatten(tree, keep_none=True)[0]}
        dtypes = {leaf.key: leaf.dtype for leaf in plan.manifest.leaves}
        same_run = self.step is not None and _parent(self.step) == _parent(final)
        digests: dict[_Key, tuple[str, bytes | None]] = {}
        arrays = {key: weakref.ref(leaf) for key, leaf in leaves.items() if isinstance(leaf, jax.Array)}
        reused, files = Reused(), []
        for file in plan.files:
            kept: list[PlannedPiece] = []
            for piece in file.pieces:
                known = self._known.get((piece.key, piece.slice)) if same_run else None
                same, digest = self._compare(piece, leaves[piece.key], dtypes[piece.key], known)
                digests[piece.key, piece.slice] = (dtypes[piece.key], digest)
                if same and known is not None:
                    reused.pieces[piece.key].append(known.entry._replace(slice=piece.slice))
                    reused.files[known.entry.file] = known.file_size
                    reused.nbytes += piece.nbytes
                else:
                    kept.append(piece)
            if kept:
                files.append(dataclasses.replace(file, pieces=tuple(kept), nbytes=sum(p.nbytes for p in kept)))
        self._pending = (digests, arrays)
        return dataclasses.replace(plan, files=tuple(files)), reused

    def _compare(self, piece: PlannedPiece, leaf: Any, dtype: str, known: _Known | None) -> tuple[bool, bytes | None]:
        """Whether the piece's bytes are ``known``'s, and its digest for the next save."""
        if isinstance(leaf, jax.Array):
            ref = self._arrays.get(piece.key)
            same = ref is not None and ref() is leaf
            return same and not leaf.is_deleted() and known is not None and known.dtype == dtype, None
        digest = _digest(piece.data)
        return known is not None and known.dtype == dtype and known.digest == digest, digest

    def committed(self, final: storage.Location, own: Manifest) -> None:
        """The save of ``apply``'s plan committed as ``final`` with this process's index ``own``."""
        digests, arrays = self._pending
        self._pending = ({}, {})
        name = _name(final)
        known: dict[_Key, _Known] = {}
        for leaf in own.leaves:
            for entry in leaf.pieces:
                dtype, digest = digests.get((leaf.key, entry.slice), ("", None))
                file = entry.file if entry.file.startswith("../") else f"../{name}/{entry.file}"
                known[leaf.key, entry.slice] = _Known(entry._replace(file=file), own.files[entry.file], dtype, digest)
        self.step, self._known, self._arrays = final, known, arrays


def _digest(data: Any) -> bytes:
    """A 128-bit digest of a host piece's bytes (C order)."""
    array = np.ascontiguousarray(np.asarray(data))
    return hashlib.blake2b(array.reshape(-1).view(np.uint8).data, digest_size=16).digest()


def _name(loc: storage.Location) -> str:
    return loc.url.rstrip("/").rsplit("/", 1)[-1]


def _parent(loc: storage.Location) -> str:
    return loc.url.rstrip("/").rsplit("/", 1)[0]
