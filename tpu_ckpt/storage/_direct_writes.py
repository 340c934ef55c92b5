"""A large local file written around the page cache: copied a chunk at a time into a
reused, page-aligned bounce buffer and written from there with ``O_DIRECT``.

Why (issue 41, ``benchmarks/kernel_reads_probe.py``): a buffered write copies every byte into
page-cache pages the kernel takes from its free memory. On a virtual machine whose free
memory the host takes back (free page reporting, virtio-balloon), the first touch of each
such page is a fault in the host: measured on a 2-core CI VM, writing 671 MB into a new
file cost 1.5-1.9 s of system time (10 s on a busier host), whatever the source (XLA's
buffers or numpy's), while the same write into pages the kernel had just freed cost 0.2 s.
``O_DIRECT`` allocates no page-cache page at all, and the bounce buffer, reused across
writes and saves, is memory the host has already backed: the same 671 MB then costs
~0.1 s of CPU in all (the memcpy, ~0.05 s user) and writes at the disk's speed.

Where the file system refuses ``O_DIRECT`` (``fcntl`` or a write fails with ``EINVAL``:
tmpfs before Linux 6.6, some FUSE and network file systems, a larger alignment than
``ALIGNMENT``), the rest of the file goes through the page cache as before. The last chunk
is written padded to ``ALIGNMENT`` with zeros and the file truncated to its size after.
Only files of at least ``CHUNK`` bytes come here, so a bounce buffer never holds more
than the file it writes (``Location.write_copies`` counts it); the ``direct_writes``
setting turns it off.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_ckpt.settings import settings

CHUNK = 8 << 20  # bytes per O_DIRECT write: larger chunks measured no faster
ALIGNMENT = 4096  # of file offsets, lengths and memory for O_DIRECT on common block devices
SUPPORTED = hasattr(os, "O_DIRECT")  # Linux; elsewhere every write is buffered


class _Bounces:
    """The process's bounce buffers: one per write in progress, kept once used (so they
    stay backed by the host) and handed to the next write."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(-1, CHUNK, flags=flags), np.uint8)

    def give_back(self, bounce: np.ndarray) -> None:
        with self._lock:
            self._free.append(bounce)


_BOUNCES = _Bounces()


def wanted(name: str, nbytes: int) -> bool:
    """Whether file ``name`` of ``nbytes`` is written here (the ``direct_writes`` setting).
    Never a JSON document (a manifest of many leaves: 14 MB for 65,536): its process's first
    such save would create a bounce buffer, kept, to spare milliseconds of page faults."""
    return SUPPORTED and nbytes >= CHUNK and settings().direct_writes and not name.endswith(".json")


def write_file(fd: int, views: Sequence[Any]) -> None:
    """Writes ``views`` (byte buffers, ``safe_reads.byte_view``) to the empty file ``fd``
    from offset 0, through a bounce buffer and ``O_DIRECT`` where the file system allows."""
    appender = Appender(fd)
    try:
        for view in views:
            appender.add(view)
        appender.finish()
    finally:
        appender.release()


class Appender:
    """The empty file ``fd`` written from offset 0 on, in order, a buffer at a time, as
    ``write_file`` writes it: what a Hugging Face export's ``FileWriter`` does while its
    writes come in order, with up to ``in_flight`` chunks being written at once on threads
    (each from a bounce buffer of its own: one stream of direct writes waits for each).
    ``detach`` writes what is gathered through the page cache and leaves ``O_DIRECT`` off,
    for a writer that goes on at other offsets; ``release`` (always called) waits for the
    writes in flight and hands the bounce buffers back."""

    def __init__(self, fd: int, in_flight: int = 1):
        self._chunks = _Chunks(fd, _BOUNCES.take(), in_flight)

    @property
    def end(self) -> int:
        """The offset the next byte added goes to."""
        return self._chunks.offset + self._chunks.fill

    def add(self, view: Any) -> None:
        self._chunks.add(np.frombuffer(view, np.uint8))

    def finish(self) -> None:
        try:
            self._chunks.finish()
        finally:
            self.release()

    def detach(self) -> None:
        try:
            chunks = self._chunks
            chunks.drain()
            chunks.direct = _set_direct(chunks.fd, False)
            chunks.put(chunks.fill)
        finally:
            self.release()

    def release(self) -> None:
        self._chunks.release()


class _Chunks:
    """The bytes of one file gathered ``CHUNK`` at a time into ``bounce`` and written out:
    here, or with ``in_flight`` > 1 on threads, that many chunks at once."""

    def __init__(self, fd: int, bounce: np.ndarray, in_flight: int = 1):
        self.fd, self.bounce = fd, bounce
        self.direct = _set_direct(fd, True)
        self.offset = 0  # of bounce[0] in the file
        self.fill = 0
        self.in_flight = in_flight
        self.writing: collections.deque[tuple[concurrent.futures.Future, np.ndarray]] = collections.deque()
        self.pool = concurrent.futures.ThreadPoolExecutor(in_flight, "tpu_ckpt-direct") if in_flight > 1 else None

    def add(self, data: np.ndarray) -> None:
        done = 0
        while done < len(data):
            n = min(len(data) - done, CHUNK - self.fill)
            self.bounce[self.fill : self.fill + n] = data[done : done + n]  # numpy copies without the GIL
            self.fill += n
            done += n
            if self.fill == CHUNK:
                self._full()

    def _full(self) -> None:
        if self.pool is None:
            self.put(CHUNK)
            return
        while len(self.writing) >= self.in_flight:
            self._wait_oldest()
        self.writing.append((self.pool.submit(_write_chunk, self.fd, self.bounce, self.offset), self.bounce))
        self.bounce = _BOUNCES.take()
        self.offset += CHUNK
        self.fill = 0

    def _wait_oldest(self) -> None:
        future, bounce = self.writing.popleft()
        try:
            future.result()
        finally:
            _BOUNCES.give_back(bounce)

    def drain(self) -> None:
        """Waits for the chunks being written; a write that found direct IO refused turned it off."""
        while self.writing:
            self._wait_oldest()
        self.direct = self.direct and _is_direct(self.fd)

    def finish(self) -> None:
        """Writes the last, partial chunk: padded with zeros to ``ALIGNMENT`` when direct,
        the padding then truncated away."""
        self.drain()
        if not self.fill:
            return
        size = self.offset + self.fill
        padded = -(-self.fill // ALIGNMENT) * ALIGNMENT if self.direct else self.fill
        self.bounce[self.fill : padded] = 0
        self.put(padded)
        if padded != self.fill:
            os.ftruncate(self.fd, size)

    def put(self, length: int) -> None:
        data = self.bounce[:length].data  # a memoryview
        done = 0
        while done < length:
            try:
                done += os.pwrite(self.fd, data[done:], self.offset + done)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                self.direct = _set_direct(self.fd, False)  # an alignment this file system refuses
        self.offset += length
        self.fill = 0

    def release(self) -> None:
        """Waits for every write in flight (one that failed has already failed the file) and
        hands the bounce buffers back."""
        while self.writing:
            future, bounce = self.writing.popleft()
            concurrent.futures.wait([future])
            _BOUNCES.give_back(bounce)
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None
        if self.bounce is not None:
            _BOUNCES.give_back(self.bounce)
            self.bounce = None  # type: ignore[assignment]


def _write_chunk(fd: int, bounce: np.ndarray, offset: int) -> None:
    """One full chunk, on a thread; where direct IO is refused, through the page cache."""
    data, done = bounce.data, 0
    while done < CHUNK:
        try:
            done += os.pwrite(fd, data[done:], offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL or not _is_direct(fd):
                raise
            _set_direct(fd, False)


def _is_direct(fd: int) -> bool:
    return SUPPORTED and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _set_direct(fd: int, on: bool) -> bool:
    """Turns ``O_DIRECT`` on or off for ``fd``; whether it is now on (a file system without
    direct IO refuses it)."""
    if not SUPPORTED:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return on
