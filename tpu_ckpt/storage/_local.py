"""The storage backend of a checkpoint on a local (or network) file system.

Local files do not go through tensorstore: measured here, tensorstore's kvstore holds two
extra copies of every value it writes (a 512 MB write peaks at +1 GB of RSS) and three while
reading one, and it only accepts ``bytes``. A small file is written with ``os.writev``
straight from the arrays' buffers; one of ``direct_writes.CHUNK`` bytes or more goes around
the page cache, through a reused bounce buffer with ``O_DIRECT`` (``_direct_writes.py``: on a
VM, the fresh page-cache pages a buffered write fills cost up to ten times the write itself);
a JSON document never does (``direct_writes.wanted``).
Reads ``preadv`` into fresh aligned arrays, which JAX's CPU backend adopts without a copy,
through ``safe_reads``, which trusts no file or name it is given: no FIFO, device or
oversized manifest, nothing outside the checkpoint, and never a mapping a later edit could
change.

A save's errors here name the file and the system's reason, with what to do about it:
``os.writev`` and ``os.fsync`` name neither (a bare ``[Errno 28]``).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import errno
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.storage import _direct_writes as direct_writes
from tpu_ckpt.storage import _safe_reads as safe_reads
from tpu_ckpt.storage._io_pool import IOPool, PooledStore

if TYPE_CHECKING:  # storage opens this backend: importing it here would be a cycle
    from tpu_ckpt.storage._location import Location


class LocalStore(PooledStore):
    """The files of one checkpoint directory (``storage.Backend``)."""

    def __init__(self, loc: Location, *, threads: int):
        self.location = loc
        self._pool = IOPool(threads)
        self._root = os.path.abspath(loc.local_path)

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        return self._pool.submit(self._write, name, buffers)

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        return self._pool.submit(self._read_ranges, name, start, lengths, then=then)

    def read_file(self, name: str, max_bytes: int = safe_reads.MAX_WHOLE_FILE_BYTES) -> bytes | None:
        """Refuses a file larger than ``max_bytes`` before reading it (a manifest symlinked
        to ``/dev/zero`` is refused as a device)."""
        return safe_reads.read_whole(self._root, name, max_bytes)

    def list(self) -> list[str]:
        if not os.path.isdir(self._root):
            return []
        return sorted(
            os.path.relpath(os.path.join(d, f), self._root) for d, _, files in os.walk(self._root) for f in files
        )

    def delete(self, name: str) -> None:
        os.unlink(os.path.join(self._root, name))

    def delete_all(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)

    def is_empty(self) -> bool:
        return not os.path.exists(self._root) or (os.path.isdir(self._root) and not os.listdir(self._root))

    def unwritten(self, sizes: Mapping[str, int]) -> builtins.list[tuple[str, int | None, int]]:
        """One stat per file."""
        wrong = []
        for name, size in sizes.items():
            path = os.path.join(self._root, name)
            try:
                found = os.stat(path).st_size
            except FileNotFoundError:
                found = None
            except OSError as e:
                raise failed("Checking", path, e) from e
            if found != size:
                wrong.append((name, found, size))
        return wrong

    def _write(self, name: str, buffers: Sequence[Any]) -> None:
        """Creates no directory: a staging area removed under a running save must make its
        next write fail, not come back holding part of the files (see ``make_directory``)."""
        path = os.path.join(self._root, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                views = [v for v in map(safe_reads.byte_view, buffers) if len(v)]
                if direct_writes.wanted(name, sum(map(len, views))):
                    direct_writes.write_file(fd, views)
                    views = []
                while views:
                    written = os.writev(fd, views[: safe_reads.IOV_MAX])
                    views = safe_reads.advance(views, written)
                os.fsync(fd)
            finally:
                os.close(fd)  # a network file system may report a lost write only here
        except OSError as e:
            raise failed("Writing", path, e) from e

    def _read_ranges(self, name: str, start: int, lengths: Sequence[int]) -> builtins.list[np.ndarray]:
        return safe_reads.read_ranges(self._root, name, start, lengths)


def make_directory(path: str) -> None:
    """A new staging directory, and any missing parent: the only place a directory is
    created, so that writes into a removed staging area fail (see ``LocalStore._write``)."""
    try:
        os.makedirs(path)
    except OSError as e:
        raise failed("Creating the staging directory", path, e) from e


def fsync_dir(path: str) -> None:
    """Makes the directory's entries (a new file, a rename) survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise failed("Syncing the directory", path, e) from e


def rename_durably(src: str, dst: str) -> None:
    """Renames the fully written directory ``src`` onto ``dst`` so that the rename survives a
    power loss: its entries synced first, the parent's after (the commit of a local save and
    of a local-tier step). A rename that fails raises OSError, for the caller to name what
    failed to commit; a sync that fails, CheckpointError, and removes ``dst`` when it came
    after the rename: a commit that raises leaves nothing behind."""
    fsync_dir(src)
    os.rename(src, dst)
    try:
        fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")
    except CheckpointError:
        shutil.rmtree(dst, ignore_errors=True)
        raise


def failed(doing: str, path: str, error: OSError) -> CheckpointError:
    """An OSError of a save's storage as a CheckpointError (see module docstring)."""
    reason = error.strerror or str(error)
    code = errno.errorcode.get(error.errno or 0)
    if code:
        reason = f"{reason} ({code})"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = "free space there or save elsewhere"
    elif error.errno == errno.EFBIG:
        advice = "raise the file size limit (`ulimit -f`) or save elsewhere"
    elif error.errno == errno.ENOENT:
        advice = "something removed the staging area while the save ran (`tpu-ckpt gc`, another job's cleanup?)"
    else:
        advice = "check that file system"
    return CheckpointError(
        f"{doing} {path} failed: {reason}. Nothing was committed: {advice}, then save again.", file=path
    )
