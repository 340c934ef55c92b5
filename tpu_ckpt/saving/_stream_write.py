"""A checkpoint written from leaves that arrive a batch at a time, by one process.

``save`` takes a whole pytree, so converting a checkpoint that does not fit in host memory
(an Orbax import) cannot go through it. Here the leaves are declared up front (their keys,
shapes, dtypes, slot flags) and their data is handed over a batch at a time: each batch
becomes one data file, written and made durable before the call returns, so nothing of it
need stay in memory. The files, the manifest and the commit are those of ``save`` (FORMAT.md),
and a converted checkpoint restores like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError, CheckpointExistsError
from tpu_ckpt.format import (
    LeafEntry,
    Manifest,
    PieceEntry,
    PlannedPiece,
    data_file_bytes,
    data_file_name,
    dtype_from_name,
    full_slice,
)
from tpu_ckpt.saving._commit import write_manifest

logger = logging.getLogger(__name__)


class StreamWriter:
    """Writes checkpoint ``path`` whose leaves are ``entries`` (array entries without pieces),
    their data given by :meth:`write`; :meth:`commit` makes it visible. Used as a context
    manager, an exception before the commit leaves nothing behind."""

    def __init__(self, path: Any, entries: Sequence[LeafEntry], description: str):
        self.final = storage.location(path)
        if not storage.is_empty(self.final):
            raise CheckpointExistsError(
                f"{self.final.url} already exists and is not empty; tpu_ckpt never overwrites a checkpoint.",
                file=self.final.url,
            )
        self._entries = list(entries)
        self._by_key = {e.key: e for e in self._entries}
        self._pieces: dict[str, PieceEntry] = {}
        self._files: dict[str, int] = {}
        self._description = description
        self._staging = self.final.staging(storage.new_token())
        self._store = storage.open_staging(self._staging)
        self._committed = False

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._store.close()
        if not self._committed:
            storage.remove(self._staging)

    def write(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Writes whole array leaves, by key, as the next data file, and waits until it is durable."""
        name = data_file_name(0, len(self._files))
        items = [(key, np.asarray(array, order="C")) for key, array in arrays.items()]  # 0-d stays 0-d
        for key, array in items:
            self._check(key, array)
        pieces = [PlannedPiece(key, full_slice(array.shape), array, array.nbytes) for key, array in items]
        laid_out = data_file_bytes(name, pieces)
        self._pieces.update((key, entry) for (key, _), entry in zip(items, laid_out.entries))
        try:
            self._store.write(name, laid_out.buffers).result()
        except CheckpointError:
            raise
        except Exception as e:
            where = self._staging.child(name)
            raise CheckpointError(f"Writing {where} failed: {e}", file=where) from e
        self._files[name] = laid_out.size

    def commit(self) -> str:
        """Writes the manifest once every array leaf has been written, and commits."""
        missing = [e.key for e in self._entries if e.kind == "array" and e.key not in self._pieces]
        if missing:
            raise CheckpointError(f"Leaves {missing[:5]} were never written; refusing to commit {self.final.url}")
        leaves = tuple(
            LeafEntry(e.key, e.path, e.kind, e.shape, e.dtype, e.is_slot, e.sharding, (self._pieces[e.key],), e.value)
            if e.kind == "array" else e
            for e in self._entries
        )
        manifest = Manifest(leaves, dict(self._files), 1, self._description)
        write_manifest(self._store, manifest)
        storage.publish(self._staging, self.final)
        self._committed = True
        return self.final.url

    def _check(self, key: str, array: np.ndarray) -> None:
        """The data must be what was declared: a manifest that lies about a leaf would make
        every later restore of it fail its checks, far from the cause."""
        entry = self._by_key.get(key)
        if entry is None or entry.kind != "array" or key in self._pieces:
            raise ValueError(f"{key!r} is not an array leaf of {self.final.url} still to be written")
        if tuple(array.shape) != entry.shape or array.dtype != dtype_from_name(entry.dtype):
            raise ValueError(
                f"Leaf {key!r}: got {array.dtype}{list(array.shape)}, declared {entry.dtype}{list(entry.shape)}"
            )

