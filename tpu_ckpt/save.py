"""save(): carries out a save plan: staging, host snapshot, writes, index, commit, callbacks.

Every process of a job calls ``save`` (SPMD). Each plans its part (``save_plan.py``) and
writes only the pieces of its own addressable devices into the staging area (``staging.py``);
the leader (process 0, or the ``io_device`` process) then merges the per-process indexes into
the manifest and commits (``commit.py``). With ``io_device`` the other processes write
through the leader (``relay.py``) and never touch storage themselves.

Synchronously, pieces are written straight from the arrays' buffers (no copy on CPU; off
CPU, one data file's pieces come to the host when a write slot is free: at most the
``writes_in_flight`` setting's number of files at a time). With ``enable_async`` every piece
is first copied to host memory (all device-to-host copies started before waiting for any),
``save`` returns, and the background writer (see ``background.py``) does the rest, holding no
reference to a device buffer, so the caller may donate or delete them at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt import commit, distributed, relay, relay_wire, storage
from tpu_ckpt.background import WRITER, SaveResult
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import Manifest, PieceEntry, data_file, dtype_name, metric_values
from tpu_ckpt.gc_pause import gc_paused
from tpu_ckpt.options import CheckpointOptions, io_process, wants_path
from tpu_ckpt.save_plan import DataFile, SavePlan, index_file, plan_save
from tpu_ckpt.settings import settings
from tpu_ckpt.slots import SlotPredicate
from tpu_ckpt.staging import Staging, prepare

logger = logging.getLogger(__name__)


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    options: CheckpointOptions | None = None,
    is_slot: SlotPredicate | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> SaveResult:
    """Saves a pytree of arrays and small Python values as a checkpoint at ``path``.

    Called by every process of a multi-process job. Raises :class:`CheckpointExistsError`
    if ``path`` already holds anything (checkpoints are never overwritten). With
    ``options.enable_async`` it returns once the data is on the host; ``wait()`` on the
    result (or the next ``save``) reports how the background write ended.

    ``is_slot(key, leaf) -> bool`` replaces the rule deciding which leaves are optimizer
    slot variables (see ``slots.py``), for optimizers the rule does not recognise.

    ``metrics`` (name -> number) go into the manifest, where ``tpu-ckpt ls`` shows them and
    CheckpointManager's best-k retention ranks checkpoints by them.
    """
    options = options or CheckpointOptions()
    metrics = None if metrics is None else metric_values(metrics)
    WRITER.settle()  # one save in flight; an unseen failure of the last one surfaces here
    if not options.enable_async:
        with gc_paused():
            job = _start(path, tree, options, is_slot, metrics)
            job.write_and_commit()
        job.run_callbacks()
        return SaveResult(job.final.url)
    with gc_paused():
        job = _start(path, tree, options, is_slot, metrics)
        try:
            job.snapshot()
        except BaseException as error:
            with job.coord:
                job.abandon(error)
            raise
    return WRITER.start(job.final.url, job.run)


def _start(
    path: str | os.PathLike[str], tree: Any, options: CheckpointOptions, is_slot: SlotPredicate | None,
    metrics: dict[str, float | int] | None,
) -> SaveJob:
    """Everything before the first byte is written: the plan, and the staging area."""
    final = storage.location(path)
    coord = distributed.Coordinator(f"save {final.url}", options.coordination_timeout)
    try:
        io = io_process(options, coord.count)
        plan = plan_save(
            tree, options, process_index=coord.me, process_count=coord.count, is_slot=is_slot, metrics=metrics
        )
        leader = 0 if io is None else io
        staging = prepare(final, coord, leader, options.coordination_timeout, relayed=io is not None)
    except BaseException as error:
        with coord:  # the save ends here
            coord.report_failure(error)
            _explain(coord, error)
        raise
    return SaveJob(plan, final, coord, leader, options, staging)


def _explain(coord: distributed.Coordinator, error: BaseException, leader: int | None = None) -> None:
    """Raises the failure of another process that caused ``error``: a lost relay connection
    usually means the other process failed; a write fails once the leader, having given up,
    removed the staging area (writes create no directory). Only reports already made count:
    this process's own error stands when no other process failed."""
    if isinstance(error, relay_wire.RelayConnectionError):
        coord.raise_if_another_failed("save", grace=2.0)
    elif leader is not None and coord.me != leader:
        coord.raise_if_another_failed("save")  # e.g. the leader gave up and removed the staging area


class SaveJob:
    """One planned save being carried out.

    It keeps the plan's manifest for the commit, and owns the data still to be written (the
    plan's arrays, or their host copies once ``snapshot`` ran), which it lets go as soon as
    it is written: an async save's copy is freed before the wait for the other processes,
    and no device buffer is referenced once ``snapshot`` returns.
    """

    def __init__(
        self, plan: SavePlan, final: storage.Location, coord: distributed.Coordinator, leader: int,
        options: CheckpointOptions, staging: Staging,
    ):
        self.manifest = plan.manifest
        self.piece_count = plan.piece_count
        self.final = final
        self.coord = coord
        self.leader = leader  # checks the destination, names the staging area, commits
        self.options = options
        self.staging = staging
        self._unwritten = plan.files
        self._own_files = (*(f.name for f in plan.files), index_file(coord.me))

    def snapshot(self) -> None:
        """Replaces the data to write by host copies (see ``host_copies``)."""
        self._unwritten = host_copies(self._unwritten)

    def run(self) -> None:
        self.write_and_commit()
        self.run_callbacks()

    def write_and_commit(self) -> None:
        started = time.perf_counter()
        coord, store = self.coord, self.staging.store
        hands_off = False  # set once this process may delete nothing any more
        try:
            own = self.write_own(store)
            if coord.me == self.leader:
                coord.collect("written", "", at=self.leader)
                others = [p for p in range(coord.count) if p != self.leader]
                commit.commit(store, self.final, self._planned(), own, others)
                hands_off = True  # committed
                coord.publish("committed")
            else:
                store.write(index_file(coord.me), [own.to_json()]).result()
                coord.collect("written", "", at=self.leader)
                # This process has written: the staging area is the leader's to commit or
                # remove. On an object store it is the final prefix, which a late removal here
                # could empty under a manifest the leader already wrote.
                hands_off = True
                coord.receive("committed", self.leader)
        except BaseException as error:
            if not hands_off:
                self.abandon(error)
            else:
                coord.report_failure(error)
                if coord.me != self.leader and coord.abandoned(self.leader):
                    self.abandon(error)  # the leader gave up uncommitted: remove what we wrote since
            _explain(coord, error, self.leader)
            raise
        finally:
            coord.close()
            self.staging.close()
        logger.info(
            "tpu_ckpt: saved %s (%d leaves, %d pieces, %d files, %.1f MB from this process) in %.2fs",
            self.final.url, len(self.manifest.leaves), self.piece_count, len(own.files), sum(own.files.values()) / 1e6,
            time.perf_counter() - started,
        )

    def write_own(self, store: storage.CheckpointStore) -> Manifest:
        """Writes this process's data files; returns its index. Each file's host bytes go
        once it is written. (The local tier's upload writes files it already has instead.)"""
        files, self._unwritten = collections.deque(self._unwritten), ()
        return write_files(store, files)

    def _planned(self) -> Manifest:
        """The plan's manifest, naming the sharding callback by its description as read now,
        after the writes, as saves always have: a callback's ``description`` is the one user
        code that runs between the writes and the commit, which tests/test_save_integrity.py
        uses to change the staging area at exactly that moment."""
        return dataclasses.replace(self.manifest, sharding_callback=self.options.sharding_callback.description)

    def abandon(self, error: BaseException) -> None:
        """Gives up on this save: tells the others, and leaves nothing in storage.

        The leader removes the staging area, whole; every other process removes only the
        files it wrote itself (after its own last write, so none of its files outlives the
        leader's removal), never the whole prefix: at a thousand hosts, a thousand listings
        and deletions of one prefix would be the leader's work done a thousand times. A
        process writing through the io_device relay has nothing of its own to remove.
        """
        self.coord.report_failure(error, abandoned=True)
        if isinstance(self.staging.store, relay.RelayStore):
            self.staging.close()
        elif self.coord.me == self.leader:
            self.staging.close()
            storage.remove(self.staging.location)
        else:
            storage.remove_files(self.staging.store, self._own_files)
            self.staging.close()

    def run_callbacks(self) -> None:
        for callback in self.options.write_callbacks:
            if wants_path(callback):
                callback(self.final.url)
            else:
                callback()


def host_copies(files: Sequence[DataFile]) -> tuple[DataFile, ...]:
    """``files`` with every piece's data replaced by one host copy of its own (see
    ``_private_host_value``), so no device buffer is referenced any more.

    All device-to-host transfers start before any is waited on, and the CPU copies run on a
    few threads (numpy releases the GIL while copying): host memory bandwidth, not one
    core, is then the limit.
    """
    pieces = [p for file in files for p in file.pieces]
    handles = [_fetch_started(p.data) for p in pieces]
    with concurrent.futures.ThreadPoolExecutor(settings().copy_threads) as pool:
        copies = iter(list(pool.map(_private_host_value, handles)))
    del handles  # off CPU, JAX's other hold on each copy: it now goes once its file is written
    return tuple(
        DataFile(file.name, tuple(dataclasses.replace(p, data=next(copies)) for p in file.pieces)) for file in files
    )


def _fetch_started(data: Any) -> Any:
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


def _private_host_value(handle: Any) -> np.ndarray:
    """The value of ``handle`` (from ``_fetch_started``) in host memory that nothing else
    writes or frees, made without a second host copy.

    Off CPU that is the copy JAX fetched: ``ArrayImpl._value`` caches a host value as
    ``_npy_value`` only when it copied (``_single_device_array_to_np_array_did_copy``),
    read-only, in memory that donating or deleting the device buffer leaves alone. On CPU
    numpy views the device buffer itself (and a numpy piece is the caller's own array), so
    that is copied once.
    """
    host = np.asarray(handle)
    if isinstance(handle, jax.Array) and getattr(handle, "_npy_value", None) is host:
        return host
    return np.array(host, copy=True)


def _host_bytes(data: Any) -> np.ndarray:
    """The bytes of ``data`` (a host array, or a handle from ``_fetch_started``, whose host
    value this then waits for) as a flat uint8 view."""
    host = np.ascontiguousarray(np.asarray(data))
    return host.reshape(-1).view(np.uint8)


def write_files(store: storage.CheckpointStore, files: collections.deque[DataFile]) -> Manifest:
    """Writes ``files``, at most ``writes_in_flight`` (a setting) at a time, taking each out
    of ``files`` as it starts, so that its host bytes go once it is written; returns this
    process's index."""
    pieces: dict[str, list[PieceEntry]] = collections.defaultdict(list)
    sizes: dict[str, int] = {}
    in_flight: collections.deque = collections.deque()
    while files:
        # Wait for a free slot *before* bringing the next file's pieces to the host.
        while len(in_flight) >= settings().writes_in_flight:
            _finish(in_flight.popleft(), store)
        name, future, entries, sizes[name] = _start_write(store, files.popleft())
        for key, entry in entries:
            pieces[key].append(entry)
        in_flight.append((name, future))
    while in_flight:
        _finish(in_flight.popleft(), store)
    return commit.index(pieces, sizes)


def _start_write(
    store: storage.CheckpointStore, file: DataFile
) -> tuple[str, concurrent.futures.Future, list[tuple[str, PieceEntry]], int]:
    """Starts writing one data file: its name, the write, its pieces' entries, its size.
    Only the write holds the file's host bytes once this returns."""
    handles = [_fetch_started(p.data) for p in file.pieces]  # every transfer starts before any is awaited
    buffers = [_host_bytes(h) for h in handles]
    tensors = [(p.key, p.slice, dtype_name(p.data.dtype), tuple(p.data.shape), b) for p, b in zip(file.pieces, buffers)]
    layout, entries = data_file(file.name, tensors)
    keyed = [(p.key, entry) for p, entry in zip(file.pieces, entries)]
    return file.name, store.write(file.name, layout.buffers(buffers)), keyed, layout.size


def _finish(pending: tuple[str, Any], store: storage.CheckpointStore) -> None:
    name, future = pending
    try:
        future.result()
    except CheckpointError:
        raise  # already names the file
    except Exception as e:
        where = store.location.child(name)
        raise CheckpointError(f"Writing {where} failed: {e}", file=where) from e
