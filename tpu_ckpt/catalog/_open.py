"""One open committed checkpoint: its store, its manifest and the piece-table rows read so far.

Every reader of a checkpoint works through one (restore, metadata, check_restore, verify,
diff, export, the Orbax interop, the manager and the command line), so a checkpoint is
opened once per use: one store, through which the manifest is read (sealed, decoded and
checked once, with the errors a user can act on) and, later, the rows of the piece tables
that the use needs, in runs. A restore's plan then looks its pieces up in what was loaded,
with no IO of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Generic, Self, TypeVar, overload

from tpu_ckpt import storage
from tpu_ckpt.catalog._committed import committed_manifest, store_tables
from tpu_ckpt.format import MANIFEST_FILE, LeafEntry, Manifest, SliceSpec, load_rows, prefetch
from tpu_ckpt.settings import settings

S = TypeVar("S", bound=storage.ReadableStore, covariant=True)
R = TypeVar("R", bound=storage.ReadableStore)


class OpenCheckpoint(Generic[S]):
    """A committed checkpoint, open for reading (a context manager: leaving it closes the
    store it opened; a store handed to :func:`open_checkpoint` stays its caller's).

    Attributes:
      store: the one store every read goes through (a relay's, for an ``io_device`` restore).
      manifest: the decoded manifest; its gridded leaves hold the rows loaded so far.
    """

    def __init__(self, store: S, manifest: Manifest, *, owned: bool = False, threads: int | None = None):
        self.store = store
        self.manifest = manifest
        self._owned = owned
        self._threads = threads

    @property
    def location(self) -> storage.Location:
        return self.store.location

    @property
    def where(self) -> str:
        """The manifest's path or URL, for error messages."""
        return self.store.location.child(MANIFEST_FILE)

    def load(self, wants: Iterable[tuple[LeafEntry, Iterable[SliceSpec]]]) -> None:
        """Reads the piece-table rows of the grid cells holding each leaf's slices (those not
        read yet), in runs: what a restore of this process's share needs, and no more."""
        load_rows(wants, self._io_threads())

    def load_all(self, leaves: Sequence[LeafEntry] | None = None) -> None:
        """Reads every row of ``leaves`` (default: all), each leaf checked whole (verify, diff,
        export)."""
        prefetch(self.manifest.leaves if leaves is None else leaves, self._io_threads())

    def _io_threads(self) -> int:
        return self._threads or settings().io_threads

    def close(self) -> None:
        if self._owned:
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@overload
def open_checkpoint(
    where: str | os.PathLike[str] | storage.Location, *, threads: int | None = None
) -> OpenCheckpoint[storage.Backend]: ...
@overload
def open_checkpoint(where: R, *, threads: int | None = None) -> OpenCheckpoint[R]: ...
def open_checkpoint(
    where: str | os.PathLike[str] | storage.Location | storage.ReadableStore, *, threads: int | None = None
) -> OpenCheckpoint[Any]:
    """Opens the committed checkpoint at ``where``: a path or URL, a location (a store with
    ``threads`` IO threads is opened, and closed with the checkpoint), or an open store (a
    relay's: its server checked the checkpoint's link, and it cannot list).

    Raises:
      CheckpointNotFoundError: nothing is committed there (or it names a directory of checkpoints).
      UncommittedCheckpointError: only a partial, never committed save is there.
      FormatVersionError, CorruptCheckpointError: the manifest is of a newer format, or unusable.
    """
    if isinstance(where, storage.ReadableStore):
        return OpenCheckpoint(where, committed_manifest(where, store_tables(where)), threads=threads)
    loc = where if isinstance(where, storage.Location) else storage.location(where)
    store = storage.Store(loc, threads=threads)
    try:
        return OpenCheckpoint(store, committed_manifest(store, store_tables(store)), owned=True, threads=threads)
    except BaseException:
        store.close()
        raise
