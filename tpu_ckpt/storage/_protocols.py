"""The store protocols, each narrower than the next: a readable store (what a restore reads
through), a checkpoint store (what a save writes through) and a backend (the storage
itself, which also lists and deletes: ``tpu-ckpt gc``, retention, the commit)."""

from __future__ import annotations

import builtins
import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, Self, runtime_checkable

import numpy as np

from tpu_ckpt.storage._location import Location
from tpu_ckpt.storage._safe_reads import MAX_WHOLE_FILE_BYTES


@runtime_checkable
class ReadableStore(Protocol):
    """The files of one checkpoint, as a restore reads them: a store, a relay to one, or a
    tier's files in memory.

    Opened on a location, then any number of ``read`` and ``read_file`` calls; ``read``
    returns futures, so callers keep many transfers in flight. Then :meth:`close` (or leave
    a ``with`` block), which waits for the transfers started.
    """

    location: Location

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: Any) -> None: ...

    def close(self) -> None: ...

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        """Starts reading consecutive byte ranges of a file, beginning at ``start``.

        Resolves to one uint8 array per length, after running ``then`` on them in the IO
        thread (e.g. checksums, which thereby run in parallel). Nothing done to the file
        later changes the arrays. From a local file or a relay they are fresh, writable and
        64-byte aligned (one read request for all of them); from an object store they may be
        read-only views of the bytes received, 16-byte aligned (``request_chunks``), so
        a caller that writes into one, or hands it to the user, copies it first. Fails with
        ``CorruptCheckpointError`` when the file is missing, too short, not a regular file,
        or named outside the checkpoint (``safe_reads``).
        """

    def read_file(self, name: str) -> bytes | None:
        """A whole small file (the manifest), or None when it does not exist."""


@runtime_checkable
class CheckpointStore(ReadableStore, Protocol):
    """The files of one checkpoint, as a save writes them (a store, or a relay to one)."""

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        """Starts writing one whole file from ``buffers`` (bytes-like); resolves once durable."""


@runtime_checkable
class Backend(CheckpointStore, Protocol):
    """A store on the storage itself, not through a relay: what also lists, deletes and
    checks a staging area (``tpu-ckpt gc``, ``CheckpointManager``'s retention, the commit)."""

    def read_file(self, name: str, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> bytes | None:
        """Refuses, with ``CorruptCheckpointError``, a file larger than ``max_bytes``."""

    def list(self) -> list[str]:
        """Every file under the location, as paths relative to it."""

    def delete(self, name: str) -> None: ...

    def delete_all(self) -> None: ...

    def is_empty(self) -> bool:
        """Whether nothing at all is stored at the location."""

    # builtins.list: below ``def list``, the name ``list`` in this class is that method
    def unwritten(self, sizes: Mapping[str, int]) -> builtins.list[tuple[str, int | None, int]]:
        """The files of ``sizes`` not here with that many bytes: (name, bytes found or None
        when missing, bytes written)."""
