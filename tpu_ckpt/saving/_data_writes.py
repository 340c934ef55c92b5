"""One process's data files on their way to storage: host copies, and the writes themselves.

A sync save writes each piece straight from its array's buffer (no copy on CPU but the
store's: a large local file goes through a bounce buffer, ``storage/_direct_writes.py``; off
CPU a file's pieces are fetched when a write slot is free). An async save first takes a host copy
of every piece (``snapshot``) so that the caller may donate its buffers at once.

Host memory is bounded twice: ``Writes`` keeps at most ``writes_in_flight`` files, and at
most ``host_memory_limit`` bytes of them, in flight, and lets go of each file's bytes as
soon as it is written. An async save's copies are recycled: the next snapshot copies into
the buffers the last one wrote from (``_SPARES``) instead of fresh memory, whose page faults
make a first copy run at a third of the memory's speed (README "Memory").
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import (
    IndexPlan,
    Manifest,
    PieceEntry,
    PlannedPiece,
    Texts,
    data_file_bytes,
    encode_parts,
    piece_rows,
)
from tpu_ckpt.saving import _commit as commit
from tpu_ckpt.saving._plan import DataFile
from tpu_ckpt.settings import settings
from tpu_ckpt.sharding import on_cpu, on_one_cpu


class _Spares:
    """The host buffers an async save's snapshot wrote from, kept for the next snapshot of
    the same layout. Only buffers this module allocated come back here, and only once their
    file is written; a snapshot takes what it can reuse and the rest is dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_layout: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = collections.defaultdict(list)

    def give_back(self, arrays: Sequence[np.ndarray]) -> None:
        if not settings().reuse_snapshot_buffers:
            return
        with self._lock:
            for array in arrays:
                if array.flags.owndata and array.flags.writeable:  # ours, not JAX's fetched copy
                    self._by_layout[array.shape, array.dtype.str].append(array)

    def take_all(self) -> dict[tuple[tuple[int, ...], str], list[np.ndarray]]:
        with self._lock:
            spares, self._by_layout = self._by_layout, collections.defaultdict(list)
        return spares


_SPARES = _Spares()


def snapshot(files: Sequence[DataFile], limit: int | None, writes: Callable[[], Writes]) -> tuple[DataFile, ...]:
    """``files`` with every piece's data replaced by a host copy (``_host_copies``), holding
    at most ``limit`` bytes of copies: the files beyond it are first written straight from
    the arrays through ``writes()`` (so the call blocks longer), and waited for, since they
    read the caller's buffers, which it may donate once this returns."""
    queue = collections.deque(files)
    rest = sum(f.nbytes for f in queue)
    if limit is not None and rest > limit:
        early = writes()
        while queue and rest > limit:
            rest -= queue[0].nbytes
            early.start(queue.popleft())
        early.drain()
    return _host_copies(queue)


def _host_copies(files: Sequence[DataFile]) -> tuple[DataFile, ...]:
    """``files`` with every piece's data replaced by one host copy of its own (see
    ``_private_host_value``), so no device buffer is referenced any more.

    All device-to-host transfers start before any is waited on, and the CPU copies run on a
    few threads (numpy releases the GIL while copying): host memory bandwidth, not one
    core, is then the limit.
    """
    handles = [fetch_started(p.data) if file.on_device else p.data for file in files for p in file.pieces]
    spares = _SPARES.take_all()
    targets = [_spare_for(h, spares) for h in handles]
    del spares  # what this snapshot cannot reuse goes now
    with concurrent.futures.ThreadPoolExecutor(settings().copy_threads) as pool:
        copies = iter(list(pool.map(_private_host_value, handles, targets)))
    del handles  # off CPU, JAX's other hold on each copy: it now goes once its file is written
    return tuple(
        dataclasses.replace(file, pieces=tuple(p._replace(data=next(copies)) for p in file.pieces)) for file in files
    )


def _spare_for(handle: Any, spares: dict[tuple[tuple[int, ...], str], list[np.ndarray]]) -> np.ndarray | None:
    """A recycled buffer to copy a CPU piece into (off CPU, JAX's fetched copy is the one)."""
    if isinstance(handle, jax.Array) and not on_one_cpu(handle):
        return None
    same = spares.get((tuple(handle.shape), np.dtype(handle.dtype).str))
    return same.pop() if same else None


def fetch_started(data: Any) -> Any:
    """``data``, or for a ``jax.Array`` a new array over the same device buffers with its
    device-to-host copy started.

    JAX keeps the host value it fetches on the array object it fetched it for, for as long
    as that object lives (``ArrayImpl._value`` caches it as ``_npy_value``, jaxlib's
    ``PyHostValue`` holds it too), and a piece's ``shard.data`` is the one object the
    caller's array caches for that shard: fetching through it would leave a host copy of
    the state on the caller's arrays until they die. ``make_array_from_single_device_arrays``
    reuses the device buffers (no device copy), so the host value lives on this handle
    instead, and goes when the save lets go of it.
    """
    if not isinstance(data, jax.Array):
        return data
    handle = jax.make_array_from_single_device_arrays(
        data.shape, data.sharding, [shard.data for shard in data.addressable_shards]
    )
    handle.copy_to_host_async()
    return handle


def _private_host_value(handle: Any, into: np.ndarray | None = None) -> np.ndarray:
    """The value of ``handle`` (from ``fetch_started``) in host memory that nothing else
    writes or frees, made without a second host copy: ``into`` when given.

    That is the copy JAX fetched where it made one: ``ArrayImpl._value`` caches a host
    value as ``_npy_value`` only when it copied (``_single_device_array_to_np_array_did_copy``),
    read-only, in memory that donating or deleting the device buffer leaves alone; and off
    CPU every fetch is such a copy, also where JAX caches none (jax 0.11 on a GPU hands back
    a view of its own host value, kept alive by the array's base; copying it again held
    three host copies of a piece at once). On CPU numpy views the device buffer itself (and
    a numpy piece is the caller's own array), so that is copied once.
    """
    host = np.asarray(handle)
    if isinstance(handle, jax.Array) and (getattr(handle, "_npy_value", None) is host or not on_cpu(handle)):
        return host
    if into is not None:
        np.copyto(into, host)
        return into
    return np.array(host, copy=True)


def write_all(writes: Writes, files: collections.deque[DataFile], *, recycle: bool = False) -> Manifest:
    """Writes ``files`` through ``writes``, taking each out of ``files`` as it starts (so
    nothing else holds its bytes once written); returns this process's index."""
    _start_all(writes, files, recycle)
    return writes.index()


def write_all_encoded(writes: Writes, files: collections.deque[DataFile], *, recycle: bool = False) -> bytes:
    """As :func:`write_all`, through ``writes`` made with a plan: the index comes encoded
    (``format.encode_index``), never having been an object per piece."""
    _start_all(writes, files, recycle)
    return writes.encoded_index()


def _start_all(writes: Writes, files: collections.deque[DataFile], recycle: bool) -> None:
    while files:
        writes.start(files.popleft(), recycle=recycle)


@dataclasses.dataclass
class _InFlight:
    name: str
    write: concurrent.futures.Future
    nbytes: int
    recycled: list[np.ndarray]  # snapshot buffers to give back once written


class Writes:
    """This process's data files being written, each let go of once written.

    ``limit`` (``host_memory_limit``) bounds the bytes of the files in flight; a file
    always starts when nothing else is in flight, so the plan keeps files under it. With a
    ``plan``, the pieces written are kept as index rows (``format.piece_rows``, ~50 bytes a
    piece) for ``encoded_index``; without, as entries for ``index``."""

    def __init__(self, store: storage.CheckpointStore, limit: int | None, plan: IndexPlan | None = None):
        self.store = store
        self.limit = limit
        self.held = 0
        self._plan = plan
        self._rows: list[dict[int, np.ndarray]] = []  # with a plan: each file's
        self._pieces: dict[str, list[PieceEntry]] = collections.defaultdict(list)
        self._sizes: dict[str, int] = {}
        self._texts = Texts()
        self._in_flight: collections.deque[_InFlight] = collections.deque()

    def make_room(self, nbytes: int) -> None:
        """Waits for earlier writes until a file of ``nbytes`` may start."""
        while self._in_flight and (
            len(self._in_flight) >= settings().writes_in_flight
            or (self.limit is not None and self.held + nbytes > self.limit)
        ):
            self._finish_oldest()

    def start(self, file: DataFile, *, recycle: bool = False) -> None:
        """Starts writing ``file`` once there is room (before its pieces come to the host).
        ``recycle``: its data are ``_host_copies``, to give back once written (``_Spares``)."""
        self.make_room(file.nbytes)
        try:
            pieces: Sequence[PlannedPiece] = file.pieces
            if file.on_device:  # every transfer starts before any is awaited
                pieces = [p._replace(data=fetch_started(p.data)) for p in pieces]
            laid_out = data_file_bytes(file.name, pieces, self._texts)
        except BaseException:
            self.settle()
            raise
        if self._plan is not None:
            self._rows.append(piece_rows(self._plan, len(self._sizes), [p.key for p in file.pieces], laid_out.entries))
        else:
            for p, entry in zip(file.pieces, laid_out.entries):
                self._pieces[p.key].append(entry)
        self._sizes[file.name] = laid_out.size
        recycled = [p.data for p in file.pieces] if recycle else []
        self._issue(file.name, laid_out.buffers, file.nbytes + laid_out.copied, recycled)

    def reference(self, pieces: Mapping[str, Sequence[PieceEntry]], files: Mapping[str, int]) -> None:
        """Adds to the index pieces already stored in an earlier step's ``files`` (an
        incremental save's, ``saving/_incremental.py``): nothing is written for them."""
        for key, entries in pieces.items():
            self._pieces[key].extend(entries)
        self._sizes.update(files)

    def copy(self, name: str, buffers: Sequence[Any]) -> None:
        """Starts writing a file whose bytes are ready (e.g. a local-tier file, mapped),
        once there is room; it is not part of the index."""
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        self.make_room(nbytes)
        self._issue(name, buffers, nbytes, [])

    def _issue(self, name: str, buffers: Sequence[Any], nbytes: int, recycled: list[np.ndarray]) -> None:
        try:
            write = self.store.write(name, buffers)
        except BaseException:
            self.settle()
            raise
        self._in_flight.append(_InFlight(name, write, nbytes, recycled))
        self.held += nbytes

    def settle(self) -> None:
        """Waits for every write in flight, whatever its outcome, and forgets them: once a
        save fails, none of its writes may still read the caller's buffers (which the caller
        may then donate), nor land after the staging area is removed."""
        pending, self._in_flight = self._in_flight, collections.deque()
        concurrent.futures.wait([p.write for p in pending])
        self.held = 0

    def drain(self) -> None:
        while self._in_flight:
            self._finish_oldest()

    def index(self) -> Manifest:
        """This process's index, once every write has finished. The pieces' entries are
        handed over: a million of them need not outlive the index."""
        self.drain()
        pieces, self._pieces = self._pieces, collections.defaultdict(list)
        self._texts = Texts()  # its texts of every key go too
        return commit.index(pieces, self._sizes)

    def encoded_index(self) -> bytes:
        """This process's index, encoded, once every write has finished (``Writes`` made
        with a plan, and no ``reference``)."""
        assert self._plan is not None and not self._pieces
        self.drain()
        rows, self._rows, self._texts = self._rows, [], Texts()
        return encode_parts(self._plan, list(self._sizes.items()), rows)

    @property
    def sizes(self) -> dict[str, int]:
        """The data files written so far, and their sizes."""
        return self._sizes

    def _finish_oldest(self) -> None:
        done = self._in_flight.popleft()
        self.held -= done.nbytes
        try:
            done.write.result()
        except BaseException as e:
            self.settle()
            if isinstance(e, CheckpointError) or not isinstance(e, Exception):
                raise  # a CheckpointError already names the file
            where = self.store.location.child(done.name)
            raise CheckpointError(f"Writing {where} failed: {e}", file=where) from e
        _SPARES.give_back(done.recycled)
