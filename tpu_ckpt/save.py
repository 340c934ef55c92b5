"""save(): tree -> pieces -> shards -> host snapshot -> writes -> index -> commit -> callbacks.

Every process of a job calls ``save`` (SPMD). Each writes only the pieces of its own
addressable devices into the staging location; the leader (process 0, or the
``io_device`` process) then merges the per-process indexes into the manifest, writes it and
commits. With ``io_device`` the other processes write through the leader (``relay.py``) and
never touch storage themselves.

Synchronously, pieces are written straight from the arrays' buffers (no copy on CPU; off
CPU, one data file's pieces come to the host when a write slot is free, at most
``MAX_WRITES_IN_FLIGHT`` files at a time). With ``enable_async`` every piece is first copied
to host memory (all device-to-host copies started before waiting for any), ``save``
returns, and the background writer (see ``background.py``) does the rest, holding no
reference to a device buffer, so the caller may donate or delete them at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt import distributed, keys, relay, shared_storage, storage
from tpu_ckpt.background import WRITER, SaveResult
from tpu_ckpt.decode import decode_manifest
from tpu_ckpt.errors import CheckpointError, CheckpointExistsError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    LeafEntry,
    Manifest,
    PieceEntry,
    crc32c,
    dtype_name,
    metric_values,
    safetensors_layout,
    tensor_name,
)
from tpu_ckpt.gc_pause import gc_paused
from tpu_ckpt.options import CheckpointOptions, io_process, wants_path
from tpu_ckpt.pieces import Shard, ShardableTensor, WriteBalance, array_pieces, describe_sharding
from tpu_ckpt.slices import tiling_problem
from tpu_ckpt.slots import SlotPredicate, slot_keys
from tpu_ckpt.validation import validate_shards

logger = logging.getLogger(__name__)

MAX_WRITES_IN_FLIGHT = 4
SNAPSHOT_THREADS = 4
_PYTHON_VALUES = (bool, int, float, str, type(None))


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
            job = _plan(path, tree, options, is_slot, metrics)
            job.write_and_commit()
        job.run_callbacks()
        return SaveResult(job.final.url)
    with gc_paused():
        job = _plan(path, tree, options, is_slot, metrics)
        try:
            job.snapshot()
        except BaseException as error:
            job.abandon(error)
            raise
    return WRITER.start(job.final.url, job.run)


def _plan(
    path: str | os.PathLike[str], tree: Any, options: CheckpointOptions, is_slot: SlotPredicate | None,
    metrics: dict[str, float | int] | None,
) -> _Job:
    """Everything before the first byte is written: pieces, shards, validation, staging."""
    final = storage.location(path)
    coord = distributed.Coordinator(f"save {final.url}", options.coordination_timeout)
    try:
        io = io_process(options, coord.count)
        leaves, _ = keys.flatten(tree, keep_none=True)
        entries, pieces = _describe(leaves, coord.me, slot_keys(tree, leaves, is_slot))
        shards = [s for s in options.sharding_callback(pieces) if s]
        validate_shards(shards, pieces, options.sharding_callback.description)
        job = _Job(final, coord, entries, shards, options, len(pieces), leader=0 if io is None else io, metrics=metrics)
        job.open_staging(relayed=io is not None)
    except BaseException as error:
        coord.report_failure(error)
        _explain(coord, error)
        raise
    return job


def _explain(coord: distributed.Coordinator, error: BaseException, leader: int | None = None) -> None:
    """Raises the failure of another process that caused ``error``: a lost relay connection
    usually means the other process failed; a write fails once the leader, having given up,
    removed the staging area (writes create no directory)."""
    if isinstance(error, relay.RelayConnectionError):
        coord.raise_if_another_failed("save", grace=2.0)
    elif leader is not None and coord.me != leader and coord.abandoned(leader):
        coord.raise_if_another_failed("save")


@dataclasses.dataclass
class _Job:
    """One save after planning: what to write where, and how to commit it."""

    final: storage.Location
    coord: distributed.Coordinator
    entries: list[LeafEntry]
    shards: list[Shard]
    options: CheckpointOptions
    piece_count: int
    leader: int  # checks the destination, names the staging area, commits
    metrics: dict[str, float | int] | None = None  # for the manifest
    staging: storage.Location | None = None
    store: storage.Store | relay.RelayStore | None = None
    server: relay.RelayServer | None = None

    def open_staging(self, relayed: bool) -> None:
        """The leader checks the destination and names the staging area (serving it to the
        others when they write through it); the others learn its name, or where to connect.
        Before anyone writes, the processes prove they all see a local staging directory
        (see ``shared_storage.py``): the leader decides when, so every process takes part."""
        coord, timeout = self.coord, self.options.coordination_timeout
        if coord.me != self.leader:
            start = json.loads(coord.receive("start", self.leader))
            self.staging = self.final.staging(start["token"])
            if start["prove_shared"]:
                shared_storage.prove_staging(coord, self.final, self.staging, self.leader)
            if start["contact"]:
                self.store = relay.RelayStore(self.staging, start["contact"], timeout, self.leader)
            else:
                self.store = storage.Store(self.staging)
            return
        if not storage.is_empty(self.final):
            raise CheckpointExistsError(
                f"{self.final.url} already exists and is not empty; tpu_ckpt never overwrites a checkpoint. "
                "Save to a new path, or delete the old one first.",
                file=self.final.url,
            )
        token = uuid.uuid4().hex[:12]
        self.staging = self.final.staging(token)
        self.store = storage.open_staging(self.staging)
        prove = not relayed and shared_storage.unproved(self.final, coord.count)
        try:
            contact = ""
            if relayed and coord.count > 1:
                self.server = relay.RelayServer(
                    self.store, distributed.relay_host(), timeout, peers=coord.count - 1,
                    accepts=functools.partial(_sent_by_another, leader=self.leader, count=coord.count),
                )
                contact = self.server.contact()
            coord.publish("start", json.dumps({"token": token, "contact": contact, "prove_shared": prove}))
            if prove:
                shared_storage.prove_staging(coord, self.final, self.staging, self.leader)
        except BaseException:
            self.close()
            storage.remove(self.staging)  # nobody else knows its name: nobody else would remove it
            raise

    def snapshot(self) -> None:
        """Replaces every piece by a host copy, so no device buffer is referenced any more.

        All device-to-host transfers start before any is waited on, and the copies run on a
        few threads (numpy releases the GIL while copying): host memory bandwidth, not one
        core, is then the limit.
        """
        arrays = [a for shard in self.shards for by_slice in shard.values() for a in by_slice.values()]
        for array in arrays:
            if isinstance(array, jax.Array):
                array.copy_to_host_async()
        with concurrent.futures.ThreadPoolExecutor(SNAPSHOT_THREADS) as pool:
            copies = iter(list(pool.map(lambda a: np.array(a, copy=True), arrays)))
        self.shards = [
            {key: {spec: next(copies) for spec in by_slice} for key, by_slice in shard.items()} for shard in self.shards
        ]

    def run(self) -> None:
        self.write_and_commit()
        self.run_callbacks()

    def write_and_commit(self) -> None:
        started = time.perf_counter()
        coord, staging, store = self.coord, self.staging, self.store
        hands_off = False  # set once this process may delete nothing any more
        try:
            index, files = _write_shards(store, self.shards, coord.me)
            self.shards = []  # the host copies can go now
            if coord.me == self.leader:
                coord.gather("written")
                _commit(store, staging, self.final, coord, self.leader, self.entries, index, files, self.options, self.metrics)
                hands_off = True  # committed
                coord.publish("committed")
            else:
                store.write(_index_file(coord.me), [_index_to_json(index, files)]).result()
                coord.gather("written")
                # Everyone has written: the staging area is the leader's to commit or remove. On
                # an object store it is the final prefix, which a late removal here could empty
                # under a manifest the leader already wrote.
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
            self.close()
        logger.info(
            "tpu_ckpt: saved %s (%d leaves, %d pieces, %d files, %.1f MB from this process) in %.2fs",
            self.final.url, len(self.entries), self.piece_count, len(files), sum(files.values()) / 1e6,
            time.perf_counter() - started,
        )

    def abandon(self, error: BaseException) -> None:
        """Gives up on this save: tells the others, and leaves nothing in storage.

        Every process that writes to storage removes the staging area after its own last
        write, so whichever removal comes last leaves nothing behind. A process writing
        through the io_device relay has nothing of its own to remove.
        """
        self.coord.report_failure(error, abandoned=True)
        self.close()
        if self.staging is not None and not isinstance(self.store, relay.RelayStore):
            storage.remove(self.staging)

    def close(self) -> None:
        """Stops serving the others (first: no late write may land after this), closes the store."""
        if self.server is not None:
            self.server.close()
        if self.store is not None:
            self.store.close()

    def run_callbacks(self) -> None:
        for callback in self.options.write_callbacks:
            if wants_path(callback):
                callback(self.final.url)
            else:
                callback()


def _describe(
    leaves: list[tuple[str, list, Any]], me: int, slots: set[str]
) -> tuple[list[LeafEntry], list[ShardableTensor]]:
    """Manifest entries (without piece locations) for every leaf, and this process's pieces."""
    entries, pieces, balance = [], [], WriteBalance()
    for key, path, leaf in leaves:
        if isinstance(leaf, _PYTHON_VALUES):
            entries.append(LeafEntry(key, path, "value", value=leaf))
            continue
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"Leaf {key!r} is a {type(leaf).__name__}; a checkpoint holds arrays and Python "
                "bool/int/float/str/None only."
            )
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"Leaf {key!r} is a typed PRNG key ({leaf.dtype}), which has no numpy dtype to store: save "
                "jax.random.key_data(key) instead, and rebuild the key with jax.random.wrap_key_data(data) after a restore."
            )
        try:
            name = dtype_name(leaf.dtype)
        except TypeError as e:
            raise TypeError(f"Leaf {key!r}: {e}") from None
        shape = tuple(int(d) for d in leaf.shape)
        slot = key in slots
        entries.append(LeafEntry(key, path, "array", shape, name, slot, describe_sharding(leaf)))
        pieces.extend(array_pieces(key, leaf, process_index=me, is_slot=slot, balance=balance))
    return entries, pieces


def _host_bytes(array: Any) -> np.ndarray:
    """The array's bytes as a flat uint8 view (a device-to-host copy off-CPU)."""
    host = np.ascontiguousarray(np.asarray(array))
    return host.reshape(-1).view(np.uint8)


def _write_shards(store: storage.Store | relay.RelayStore, shards: Sequence[Shard], me: int) -> tuple[dict[str, list[PieceEntry]], dict[str, int]]:
    index: dict[str, list[PieceEntry]] = collections.defaultdict(list)
    files: dict[str, int] = {}
    in_flight: collections.deque = collections.deque()
    for number, shard in enumerate(shards):
        # Wait for a free slot *before* bringing this file's pieces to the host.
        while len(in_flight) >= MAX_WRITES_IN_FLIGHT:
            _finish(in_flight.popleft(), store)
        name = _data_file(me, number)
        items = [(key, spec, array) for key, by_slice in shard.items() for spec, array in by_slice.items()]
        buffers = [_host_bytes(array) for _, _, array in items]
        layout = safetensors_layout(
            [(tensor_name(key, spec), dtype_name(array.dtype), tuple(array.shape), buf.nbytes)
             for (key, spec, array), buf in zip(items, buffers)]
        )
        for (key, spec, _), buf, offset in zip(items, buffers, layout.offsets):
            index[key].append(PieceEntry(spec, name, offset, buf.nbytes, crc32c(buf)))
        in_flight.append((name, store.write(name, layout.buffers(buffers))))
        files[name] = layout.size
        del buffers
    while in_flight:
        _finish(in_flight.popleft(), store)
    return index, files


def _finish(pending: tuple[str, Any], store: storage.Store) -> None:
    name, future = pending
    try:
        future.result()
    except CheckpointError:
        raise  # already names the file
    except Exception as e:
        where = store.location.child(name)
        raise CheckpointError(f"Writing {where} failed: {e}", file=where) from e


def _data_file(process: int, number: int) -> str:
    return f"d{process:05d}-{number:05d}.safetensors"


def _index_file(process: int) -> str:
    return f"index-{process:05d}.json"


_SENT_FILE = re.compile(r"d(\d{5,9})-\d{5,9}\.safetensors|index-(\d{5,9})\.json")


def _sent_by_another(name: str, leader: int, count: int) -> bool:
    """What the io_device leader's relay accepts: the data files and index of another
    process of this job (as ``_data_file`` and ``_index_file`` name them), nothing else."""
    match = _SENT_FILE.fullmatch(name)
    if match is None:
        return False
    process = int(match[1] or match[2])
    return process != leader and process < count


def _index_to_json(index: dict[str, list[PieceEntry]], files: dict[str, int]) -> bytes:
    """A process's piece locations, in manifest form so one parser reads both."""
    entries = tuple(LeafEntry(key, [], "array", pieces=tuple(p)) for key, p in index.items())
    return Manifest(entries, files, 0, "").to_json()


def _commit(
    store: storage.Store,
    staging: storage.Location,
    final: storage.Location,
    coord: distributed.Coordinator,
    leader: int,
    entries: list[LeafEntry],
    index: dict[str, list[PieceEntry]],
    files: dict[str, int],
    options: CheckpointOptions,
    metrics: dict[str, float | int] | None,
) -> None:
    """The leader: merges every process's index into the manifest, writes it, commits."""
    for process in range(coord.count):
        if process == leader:
            continue
        name = _index_file(process)
        theirs = decode_manifest(store.read_file(name) or b"", where=staging.child(name), complete=False)
        files.update(theirs.files)
        for leaf in theirs.leaves:
            index.setdefault(leaf.key, []).extend(leaf.pieces)
        store.delete(name)
    leaves = tuple(
        LeafEntry(e.key, e.path, e.kind, e.shape, e.dtype, e.is_slot, e.sharding,
                  tuple(sorted(index.get(e.key, ()), key=lambda p: p.slice)), e.value)
        for e in entries
    )
    for leaf in leaves:
        _check_covered(leaf)
    manifest = Manifest(
        leaves, dict(sorted(files.items())), coord.count, options.sharding_callback.description, metrics=metrics
    )
    store.check_written(manifest.files)
    store.write(MANIFEST_FILE, [manifest.to_json()]).result()
    storage.commit(staging, final)


def _check_covered(leaf: LeafEntry) -> None:
    """Guards against committing a leaf whose merged pieces miss or repeat a block."""
    if leaf.kind != "array":
        return
    problem = tiling_problem(leaf.shape, [p.slice for p in leaf.pieces])
    if problem:
        raise CheckpointError(
            f"Leaf {leaf.key!r}: {problem}; refusing to commit an inconsistent checkpoint. "
            "Are all processes saving the same tree?",
            key=leaf.key,
        )
