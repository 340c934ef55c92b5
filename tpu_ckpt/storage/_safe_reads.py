"""Reading checkpoint files without trusting them.

A checkpoint directory may have been edited by hand, damaged, or built to do harm, and a
relayed restore reads names a remote process sends. The rule, for every file we read:
its bytes come from a regular file inside the checkpoint (or the local tier's directory),
and are checked before they are trusted. So every local file is opened through
:func:`open_confined`, which refuses a name leading out of the checkpoint (:func:`confine`;
object-store keys too, :func:`escapes`) and a symbolic link or directory that resolves out
of it, never waits on a FIFO or opens a device (files are opened non-blocking and anything
but a regular file is refused); and a file's size is checked before memory is allocated for
it: a manifest symlinked to ``/dev/zero``, a data file linked to ``/etc/passwd`` or a
manifest entry claiming a 1 TiB piece fails at once with :class:`CorruptCheckpointError`.

Data is read with ``preadv`` into fresh memory, never mapped: a restored array must not
change, nor the process die of SIGBUS, when a data file is later edited, truncated or
deleted, which is what a mapping of the page cache does. Reads are exact (the manifest
says where each piece is) and ``POSIX_FADV_RANDOM`` turns the kernel's readahead off, so a
partial restore from a cold cache fetches little beyond the pieces it needs rather than
the device's readahead window around each of them.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import ALIGNMENT, MANIFEST_FILE, REFERENCED_FILE

# The largest whole file (a manifest) read_whole reads by default: far beyond any real
# manifest (a few hundred bytes per leaf), small enough to hold in memory.
MAX_WHOLE_FILE_BYTES = 1 << 30

IOV_MAX = 1024

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # non-blocking: a FIFO opens at once


def escapes(name: str) -> bool:
    """Whether a file name, once normalised, is absolute or leads out of its directory."""
    normal = os.path.normpath(name) if name else os.curdir
    return os.path.isabs(normal) or normal == os.curdir or os.pardir in normal.split(os.sep)


_STEP_REFERENCE = re.compile(r"\.\./(step_[0-9]+)/([^/\\]+)")


def step_reference(name: str) -> tuple[str, str] | None:
    """The sibling step and file an object store's checkpoint may name besides its own files:
    ``../step_<digits>/<plain file name>`` (an incremental save's reference, FORMAT.md
    "References"), and nothing else that leads out of it. None for any other name."""
    match = _STEP_REFERENCE.fullmatch(name)
    if match is None or match.group(2) in (os.curdir, os.pardir):
        return None
    return match.group(1), match.group(2)


def confine(root: str, name: str) -> str:
    """The path of file ``name`` of the local checkpoint at ``root``; refuses names that
    lead out of it (see :func:`outside_error`).

    The one exception is the form a linked checkpoint (``export_for_serving(link=True)``)
    uses for its source's files, ``../<sibling>/<file>``, accepted only where that sibling
    directory holds a ``manifest.json``, i.e. is itself a checkpoint (or ``referenced.json``,
    a step kept for the files an incremental save references): ``../etc/passwd``
    beside a checkpoint at ``/ckpt`` is refused like ``../../x`` and ``/etc/passwd``.
    """
    return _confined(root, name)[1]


def _confined(root: str, name: str) -> tuple[str, str]:
    """The directory ``name`` must stay inside (``root``, or a linked checkpoint's source),
    and the file's path (see :func:`confine`)."""
    if not escapes(name):
        return root, os.path.join(root, os.path.normpath(name))
    parts = os.path.normpath(name).split(os.sep)
    if len(parts) >= 3 and parts[0] == os.pardir and not escapes(os.path.join(*parts[2:])):
        sibling = os.path.join(os.path.dirname(root.rstrip(os.sep)), parts[1])
        if parts[1] != os.pardir and any(
            os.path.isfile(os.path.join(sibling, f)) for f in (MANIFEST_FILE, REFERENCED_FILE)
        ):
            return sibling, os.path.join(sibling, *parts[2:])
        if step_reference(name) is not None:
            raise CorruptCheckpointError(
                f"{root} is an incremental step whose data file {name!r} is held by step {sibling}, which was deleted "
                f"(it holds neither {MANIFEST_FILE} nor {REFERENCED_FILE}): an incremental step needs the steps it "
                "references. Restore another checkpoint, or put that step back.",
                file=os.path.join(sibling, *parts[2:]),
            )
    raise outside_error(root, name)


def open_confined(root: str, name: str) -> int:
    """A read-only descriptor of the regular file ``name`` of the checkpoint (or local-tier
    directory) at ``root``: the one way a local file of ours is opened for reading.
    FileNotFoundError if there is none.

    The name is checked (:func:`confine`), and so is the path it resolves to: a symbolic
    link, or a directory on the way, leading out of ``root`` (out of the sibling, for a
    linked checkpoint's ``../<sibling>/<file>``) is refused before anything is opened, so no
    device outside is ever opened either; so is a sibling that is itself a link out of
    ``root``'s parent directory. The file actually opened is checked once more
    (``/proc/self/fd``), so a link swapped in meanwhile is caught too."""
    base, path = _confined(root, name)
    inside = os.path.realpath(base)
    parent = os.path.dirname(root.rstrip(os.sep))
    if base != root and not _inside(inside, os.path.realpath(parent)):
        raise CorruptCheckpointError(
            f"{base}, the source of linked checkpoint {root}, leads, through a symbolic link, to {inside}, outside "
            f"{parent}: a linked checkpoint reads only the files of a checkpoint beside it. Export it again "
            "without link=True, or restore its source.",
            file=base,
        )
    resolved = os.path.realpath(path)
    if not _inside(resolved, inside):
        raise _leads_out(base, path, resolved)
    fd = open_regular(resolved, shown=path, flags=os.O_NOFOLLOW)
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the check of the resolved path stands
        opened = resolved
    if not _inside(opened, inside):
        os.close(fd)
        raise _leads_out(base, path, opened)
    return fd


def _inside(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip(os.sep) + os.sep)


def _leads_out(root: str, path: str, resolved: str) -> CorruptCheckpointError:
    try:
        kind = _kind(os.stat(resolved).st_mode) if not os.path.isfile(resolved) else "regular file"
    except OSError:
        kind = "missing file"
    return CorruptCheckpointError(
        f"{path} leads, through a symbolic link, to {resolved}, which is a {kind} outside checkpoint "
        f"{root}: a checkpoint reads only its own regular files. Replace the link with the file the "
        "checkpoint was saved with, or restore another checkpoint.",
        file=path,
    )


def outside_error(where: str, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{name!r} names a file outside checkpoint {where}: a checkpoint names only its own "
        "files (or, when linked, those of a sibling checkpoint). Its manifest has been edited "
        "or damaged; restore another checkpoint.",
        file=f"{where.rstrip('/')}/{name}",
    )


def open_regular(path: str, *, shown: str | None = None, flags: int = 0) -> int:
    """A read-only descriptor of a regular file; FileNotFoundError if there is none.
    ``shown``: the path errors name (the one the checkpoint names, before resolving links).

    Opened non-blocking, so that a FIFO cannot make us wait for a writer forever, and
    refused unless it is a regular file (FIFO, device, socket, directory)."""
    shown = shown or path
    try:
        fd = os.open(path, _OPEN_FLAGS | flags)
    except FileNotFoundError:
        raise  # what absence means is the caller's to say (missing data, or no manifest)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket, or a device with no driver behind it
            raise _not_regular(shown, "socket or device") from None
        raise CheckpointError(f"Could not open {shown}: {e.strerror}", file=shown) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(shown, _kind(mode))
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


def read_whole(root: str, name: str, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> bytes | None:
    """The whole regular file ``name`` of ``root`` (:func:`open_confined`), of at most
    ``max_bytes``, or None when it does not exist."""
    try:
        fd = open_confined(root, name)
    except FileNotFoundError:
        return None
    path = confine(root, name)
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


def read_ranges(root: str, name: str, start: int, lengths: Sequence[int]) -> list[np.ndarray]:
    """Consecutive byte ranges of data file ``name`` of ``root`` (:func:`open_confined`),
    beginning at ``start``, as fresh aligned arrays.

    The file's size is checked against the ranges before any memory is allocated."""
    path = confine(root, name)
    try:
        fd = open_confined(root, name)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"data file {path} is missing", file=path) from None
    try:
        stop = start + sum(lengths)
        size = os.fstat(fd).st_size
        if size < stop:
            raise CorruptCheckpointError(f"{path} is truncated: it ends at byte {size}, before {stop}", file=path)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exact reads: no readahead (module docstring)
        out = [aligned_empty(n) for n in lengths]
        views, offset = [a.data for a in out if a.size], start
        while views:
            n = os.preadv(fd, views[:IOV_MAX], offset)
            if n == 0:  # shrunk since the fstat
                raise CorruptCheckpointError(f"{path} is truncated: it ends at byte {offset}, before {stop}", file=path)
            views, offset = advance(views, n), offset + n
        return out
    finally:
        os.close(fd)


def read_json(root: str, name: str, max_bytes: int) -> Any:
    """The JSON document in the small file ``name`` of ``root`` (a local tier's
    ``tier.json``), or None when it does not exist; anything else than JSON we could have
    written (too long, too deep, not UTF-8) is a :class:`CorruptCheckpointError`."""
    data = read_whole(root, name, max_bytes)
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to be ours
        where = confine(root, name)
        raise CorruptCheckpointError(f"{where} is not valid JSON ({str(e)[:200]})", file=where) from None


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on a 64-byte boundary.

    JAX's CPU backend adopts such host buffers without copying (``device_put`` aliases them),
    so a restore onto CPU devices costs no copy beyond the read itself.
    """
    try:
        if nbytes >= _PREFAULT_FROM_BYTES:
            return _prefaulted(nbytes)
        raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    except (MemoryError, OSError) as e:  # OSError: ENOMEM from mmap
        raise CheckpointError(
            f"Could not allocate {nbytes} bytes to read into ({e.__class__.__name__}: {e}): a piece or file "
            "that large does not fit in this process's memory. If the checkpoint claims more than it holds "
            "it is damaged: restore another one; else restore on a host with more memory."
        ) from None
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
    ``data_layout.data_file_bytes``), else a byte-cast memoryview, which costs microseconds a piece at
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
