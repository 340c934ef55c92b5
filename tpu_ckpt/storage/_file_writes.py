"""One file written a part at a time, at given offsets: what a Hugging Face export writes
(``interop/_hf_export.py``), whose files hold whole tensors that may be bigger than the
host memory allowed.

On a local disk the file is written under a temporary name beside its own, each part as it comes (so at most one part is
in memory), synced, then renamed onto its name: a reader never sees it half-written. A file of a known ``size`` of at
least ``direct_writes.CHUNK`` bytes is written around the page cache, through a bounce buffer and ``O_DIRECT`` as a
save's data files are (``_direct_writes.py``), while its parts come in order (an export's do, unless a tensor is
transposed), ``WRITES_IN_FLIGHT`` chunks at once (fewer when ``memory`` bounds their bounce buffers); from the first
part out of order on, with ``os.pwritev`` at its offset. An object store has no writes at offsets: there the parts are
kept and the object is put whole, once, when the file is closed (an object appears whole or not at all), so the file's
bytes are in memory once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tpu_ckpt.storage import _direct_writes as direct_writes
from tpu_ckpt.storage import _safe_reads as safe_reads
from tpu_ckpt.storage._local import failed, fsync_dir, make_directory
from tpu_ckpt.storage._location import Location, new_token
from tpu_ckpt.storage._stores import Store

WRITES_IN_FLIGHT = 4  # direct writes of one file at once, each from a bounce buffer of its own


class FileWriter:
    """Writes file ``name`` of directory (or prefix) ``loc``; use it as a context manager:
    the file is committed when the block ends without an exception, and nothing of it is
    left when it ends with one."""

    def __init__(self, loc: Location, name: str, size: int | None = None, memory: int | None = None):
        self._loc, self._name = loc, name
        self._parts: dict[int, list[bytes]] = {}
        self._fd: int | None = None
        self._append: direct_writes.Appender | None = None
        if loc.is_local:
            self._path = safe_reads.confine(os.path.abspath(loc.local_path), name)
            self._partial = f"{self._path}.tmp-{new_token()}"
            try:
                self._fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as e:
                raise failed("Creating", self._partial, e) from e
            if size is not None and direct_writes.wanted(name, size):
                in_flight = WRITES_IN_FLIGHT if memory is None else min(WRITES_IN_FLIGHT, memory // direct_writes.CHUNK)
                self._append = direct_writes.Appender(self._fd, max(1, in_flight))

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self._commit()
            return
        if self._append is not None:
            self._append.release()
        if self._fd is not None:
            os.close(self._fd)
            os.unlink(self._partial)

    def write_at(self, offset: int, buffers: Sequence[Any]) -> None:
        """Writes ``buffers`` (bytes-like) one after another from byte ``offset``."""
        if self._fd is None:
            self._parts[offset] = [bytes(safe_reads.byte_view(b)) for b in buffers]
            return
        views = [v for v in map(safe_reads.byte_view, buffers) if len(v)]
        try:
            if self._append is not None and offset == self._append.end:
                for view in views:
                    self._append.add(view)
                return
            appender, self._append = self._append, None
            if appender is not None:
                appender.detach()
            while views:
                written = os.pwritev(self._fd, views[: safe_reads.IOV_MAX], offset)
                views, offset = safe_reads.advance(views, written), offset + written
        except OSError as e:
            raise failed("Writing", self._partial, e) from e

    def _commit(self) -> None:
        if self._fd is None:
            ordered = [part for _, parts in sorted(self._parts.items()) for part in parts]
            with Store(self._loc, threads=1) as store:
                store.write(self._name, [b"".join(ordered)]).result()
            return
        fd, self._fd = self._fd, None
        try:
            appender, self._append = self._append, None
            if appender is not None:
                appender.finish()
            os.fsync(fd)
        except OSError as e:
            raise failed("Syncing", self._partial, e) from e
        finally:
            os.close(fd)
        os.rename(self._partial, self._path)
        fsync_dir(os.path.dirname(self._path))


def ensure_directory(loc: Location) -> None:
    """Creates the local directory ``loc`` (and any missing parent) unless it exists; an
    object-store prefix needs none."""
    if loc.is_local and not os.path.isdir(loc.local_path):
        make_directory(os.path.abspath(loc.local_path))


def file_size(loc: Location, name: str) -> int | None:
    """The size of local file ``name`` of ``loc`` (following no link out of it), or None on
    an object store, where a read past the end is what reports a short object."""
    if not loc.is_local:
        return None
    fd = safe_reads.open_confined(os.path.abspath(loc.local_path), name)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
