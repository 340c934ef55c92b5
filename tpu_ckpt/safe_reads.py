"""Reading checkpoint files without trusting them.

A checkpoint directory may have been edited by hand, damaged, or built to do harm, and a
relayed restore reads names a remote process sends. So a read never follows a name out of
the checkpoint (:func:`confine`; object-store keys too, :func:`escapes`), never waits on a
FIFO or reads a device (files are opened non-blocking and anything but a regular file is
refused), and checks a file's size before allocating memory for it: a manifest symlinked
to ``/dev/zero`` or a manifest entry claiming a 1 TiB piece fails at once with
:class:`CorruptCheckpointError`.

Data is read with ``preadv`` into fresh memory, never mapped: a restored array must not
change, nor the process die of SIGBUS, when a data file is later edited, truncated or
deleted, which is what a mapping of the page cache does. Reads are exact (the manifest
says where each piece is) and ``POSIX_FADV_RANDOM`` turns the kernel's readahead off, so a
partial restore from a cold cache fetches little beyond the pieces it needs rather than
the device's readahead window around each of them.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import ALIGNMENT, MANIFEST_FILE

# The largest whole file (a manifest) read_whole reads by default: far beyond any real
# manifest (a few hundred bytes per leaf), small enough to hold in memory.
MAX_WHOLE_FILE_BYTES = 1 << 30

IOV_MAX = 1024

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # non-blocking: a FIFO opens at once


def escapes(name: str) -> bool:
    """Whether a file name, once normalised, is absolute or leads out of its directory."""
    normal = os.path.normpath(name) if name else os.curdir
    return os.path.isabs(normal) or normal == os.curdir or os.pardir in normal.split(os.sep)


def confine(root: str, name: str) -> str:
    """The path of file ``name`` of the local checkpoint at ``root``; refuses names that
    lead out of it (see :func:`outside_error`).

    The one exception is the form a linked checkpoint (``export_for_serving(link=True)``)
    uses for its source's files, ``../<sibling>/<file>``, accepted only where that sibling
    directory holds a ``manifest.json``, i.e. is itself a checkpoint: ``../etc/passwd``
    beside a checkpoint at ``/ckpt`` is refused like ``../../x`` and ``/etc/passwd``.
    """
    if not escapes(name):
        return os.path.join(root, os.path.normpath(name))
    parts = os.path.normpath(name).split(os.sep)
    if len(parts) >= 3 and parts[0] == os.pardir and not escapes(os.path.join(*parts[2:])):
        sibling = os.path.join(os.path.dirname(root.rstrip(os.sep)), parts[1])
        if parts[1] != os.pardir and os.path.isfile(os.path.join(sibling, MANIFEST_FILE)):
            return os.path.join(sibling, *parts[2:])
    raise outside_error(root, name)


def outside_error(where: str, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{name!r} names a file outside checkpoint {where}: a checkpoint names only its own "
        "files (or, when linked, those of a sibling checkpoint). Its manifest has been edited "
        "or damaged; restore another checkpoint.",
        file=f"{where.rstrip('/')}/{name}",
    )


def open_regular(path: str) -> int:
    """A read-only descriptor of a regular file; FileNotFoundError if there is none.

    Opened non-blocking, so that a FIFO cannot make us wait for a writer forever, and
    refused unless it is a regular file (FIFO, device, socket, directory)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise  # what absence means is the caller's to say (missing data, or no manifest)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket, or a device with no driver behind it
            raise _not_regular(path, "socket or device") from None
        raise CheckpointError(f"Could not open {path}: {e.strerror}", file=path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, _kind(mode))
    return fd


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for test, name in kinds if test(mode)), "special file")


def _not_regular(path: str, kind: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is a {kind}, not a regular file: a checkpoint holds regular files only. "
        "Replace it with the file the checkpoint was saved with, or restore another checkpoint.",
        file=path,
    )


def read_whole(path: str, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> bytes | None:
    """A whole regular file of at most ``max_bytes``, or None when it does not exist."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise CorruptCheckpointError(
                f"{path} is {size} bytes, more than the {max_bytes} a checkpoint's {os.path.basename(path)} "
                "may be: it is not a file tpu_ckpt wrote. Restore another checkpoint.",
                file=path,
            )
        data = bytearray(size)
        view, done = memoryview(data), 0
        while done < size and (n := os.readv(fd, [view[done:]])):
            done += n
        return bytes(view[:done])
    finally:
        os.close(fd)


def read_ranges(path: str, start: int, lengths: Sequence[int]) -> list[np.ndarray]:
    """Consecutive byte ranges of a data file, beginning at ``start``, as fresh aligned arrays.

    The file's size is checked against the ranges before any memory is allocated."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"data file {path} is missing", file=path) from None
    try:
        stop = start + sum(lengths)
        size = os.fstat(fd).st_size
        if size < stop:
            raise CorruptCheckpointError(f"{path} is truncated: it ends at byte {size}, before {stop}", file=path)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exact reads: no readahead (module docstring)
        out = [aligned_empty(n) for n in lengths]
        views, offset = [memoryview(a) for a in out if a.size], start
        while views:
            n = os.preadv(fd, views[:IOV_MAX], offset)
            if n == 0:  # shrunk since the fstat
                raise CorruptCheckpointError(f"{path} is truncated: it ends at byte {offset}, before {stop}", file=path)
            views, offset = advance(views, n), offset + n
        return out
    finally:
        os.close(fd)


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on a 64-byte boundary.

    JAX's CPU backend adopts such host buffers without copying (``device_put`` aliases them),
    so a restore onto CPU devices costs no copy beyond the read itself.
    """
    if nbytes >= _PREFAULT_FROM_BYTES:
        return _prefaulted(nbytes)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    skip = -raw.ctypes.data % ALIGNMENT
    return raw[skip : skip + nbytes]


_PREFAULT_FROM_BYTES = 2 << 20


def _prefaulted(nbytes: int) -> np.ndarray:
    """Fresh page-aligned memory whose pages the kernel maps in one call (``MAP_POPULATE``)
    rather than one fault per 4 KiB page during the read: measured here, a 600 MB restore
    from the page cache took 0.26 s instead of 0.29-0.40 s. (Transparent huge pages were
    faster on average but stalled up to a second on compaction.) The mapping lives as long
    as the array does."""
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return np.frombuffer(area, np.uint8)


def byte_view(buffer: Any) -> Any:
    """``buffer`` as something whose ``len`` counts bytes and whose slices drop bytes: itself
    when it is already (``bytes``, a flat byte view or uint8 array, as a save's pieces are:
    ``data_layout.data_file``), else a byte-cast memoryview, which costs microseconds a piece at
    a million pieces."""
    kind = type(buffer)
    if kind is bytes or (kind is memoryview and buffer.format == "B" and buffer.ndim == 1 and buffer.c_contiguous):
        return buffer
    if kind is np.ndarray and buffer.dtype == np.uint8 and buffer.ndim == 1 and buffer.flags.c_contiguous:
        return buffer
    return memoryview(buffer).cast("B")


def advance(views: list[memoryview], done: int) -> list[memoryview]:
    """Drops the first ``done`` bytes from a list of buffers (readv/writev may stop short)."""
    first = 0
    while first < len(views) and done >= len(views[first]):
        done -= len(views[first])
        first += 1
    rest = views[first:]  # one copy of the list: dropping one view at a time was quadratic
    if rest and done:
        rest[0] = rest[0][done:]
    return rest
