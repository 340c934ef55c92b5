"""save(): carries out a save plan: staging, host snapshot, writes, index, commit, callbacks.

Every process of a job calls ``save`` (SPMD). Each plans its part (``saving/_plan.py``) and
writes only the pieces of its own addressable devices into the staging area (``saving/_staging.py``);
the leader (process 0, or the ``io_device`` process) then merges the per-process indexes into
the manifest and commits (``saving/_commit.py``). With ``io_device`` the other processes write
through the leader (``relay/_client.py``) and never touch storage themselves.

Synchronously, pieces are written straight from the arrays' buffers (no copy on CPU; off
CPU, one data file's pieces come to the host when a write slot is free: at most the
``writes_in_flight`` setting's number of files at a time). With ``enable_async`` every piece
is first copied to host memory (all device-to-host copies started before waiting for any),
``save`` returns, and the background writer (see ``saving/_background.py``) does the rest, holding no
reference to a device buffer, so the caller may donate or delete them at once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.format import IndexPlan, Manifest, encode_index, metric_values, staged_index_file, values_file_name
from tpu_ckpt.options import CheckpointOptions, checked_options, io_process, path_callbacks
from tpu_ckpt.runtime import gc_paused
from tpu_ckpt.saving import _commit as commit
from tpu_ckpt.saving import _data_writes as data_writes
from tpu_ckpt.saving import _per_process as per_process
from tpu_ckpt.saving._background import WRITER, SaveResult
from tpu_ckpt.saving._incremental import Incremental, Reused
from tpu_ckpt.saving._plan import SavePlan, plan_save
from tpu_ckpt.saving._staging import Staging, prepare, remove_staging
from tpu_ckpt.settings import settings
from tpu_ckpt.sharding import SlotPredicate

logger = logging.getLogger(__name__)


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    options: CheckpointOptions | None = None,
    is_slot: SlotPredicate | None = None,
    metrics: Mapping[str, Any] | None = None,
    incremental: Incremental | None = None,
) -> SaveResult:
    """Saves a pytree of arrays and small Python values as a checkpoint at ``path``.

    Called by every process of a multi-process job. With ``options.enable_async`` it returns
    once the data is on the host; ``wait()`` on the result (or the next ``save``) reports
    how the background write ended.

    Args:
      path: the checkpoint directory or URL (``memory://``, ``gs://``, ``s3://``); it must
        not exist yet, or be empty.
      tree: a pytree whose leaves are ``jax.Array``, numpy arrays or small Python values.
      options: :class:`CheckpointOptions`; ``None`` means the defaults.
      is_slot: ``is_slot(key, leaf) -> bool`` replaces the rule deciding which leaves are
        optimizer slot variables (see ``sharding/_slots.py``), for optimizers it does not recognise.
      metrics: name -> number, stored in the manifest: ``tpu-ckpt ls`` shows them and
        CheckpointManager's best-k retention ranks checkpoints by them.
      incremental: what the last save of this run wrote (``CheckpointManager(incremental=True)``):
        pieces whose bytes it holds are referenced, not written again (``saving/_incremental.py``).

    Returns:
      A :class:`SaveResult`; its ``wait()`` returns ``path`` once the save is committed.

    Raises:
      CheckpointExistsError: ``path`` already holds something (nothing is ever overwritten).
      InvalidShardsError: the sharding callback's shards do not cover each piece once.
      CoordinationTimeoutError: another process did not reach a stage of the save in time.
      RemoteProcessError: another process of the job failed the save.
      CheckpointError: the storage write failed (the checkpoint stays uncommitted).
    """
    options = checked_options(options, "save")
    metrics = None if metrics is None else metric_values(metrics)
    WRITER.settle()  # one save in flight; an unseen failure of the last one surfaces here
    if not options.enable_async:
        with gc_paused():
            job = _start(path, tree, options, is_slot, metrics, incremental)
            job.write_and_commit()
        job.run_callbacks()
        return SaveResult(job.final.url)
    with gc_paused():
        job = _start(path, tree, options, is_slot, metrics, incremental)
        try:
            job.snapshot()
        except BaseException as error:
            with job.coord:
                job.abandon(error)
            raise
    return WRITER.start(job.final.url, job.run)


def _start(
    path: str | os.PathLike[str], tree: Any, options: CheckpointOptions, is_slot: SlotPredicate | None,
    metrics: dict[str, float | int] | None, incremental: Incremental | None = None,
) -> SaveJob:
    """Everything before the first byte is written: the plan, and the staging area."""
    final = storage.location(path)
    coord = cluster.Coordinator(f"save {final.url}", options.coordination_timeout)
    try:
        io = io_process(options, coord.count)
        plan = plan_save(
            tree, options, process_index=coord.me, process_count=coord.count, is_slot=is_slot, metrics=metrics,
            max_file_bytes=largest_file(final, options),
        )
        reused = None
        if incremental is not None:
            plan, reused = incremental.apply(plan, tree, final)
        leader = 0 if io is None else io
        if io == coord.me and coord.count > 1:
            relay.warn_if_beyond(
                "save", final.url, _job_bytes(plan.manifest), options.coordination_timeout, _local_parent(final)
            )
        staging = prepare(final, coord, leader, options.coordination_timeout, relayed=io is not None)
    except BaseException as error:
        with coord:  # the save ends here
            coord.report_failure(error)
            _explain(coord, error)
        raise
    return SaveJob(plan.named(staging.token), final, coord, leader, options, staging, incremental, reused)


def _job_bytes(manifest: Manifest) -> int:
    """The bytes of a save's arrays, every process's together: what io_device's process writes."""
    return sum(leaf.nbytes for leaf in manifest.leaves)


def _local_parent(final: storage.Location) -> str | None:
    return os.path.dirname(os.path.abspath(final.local_path.rstrip("/"))) if final.is_local else None


def largest_file(final: storage.Location, options: CheckpointOptions) -> int | None:
    """The most bytes a data file may hold: one object on an object store; under
    ``host_memory_limit``, a share of it, so that several files are written at once."""
    bounds = [] if final.is_local else [settings().object_bytes]
    budget = write_budget(final, options)
    if budget is not None:
        bounds.append(budget // settings().writes_in_flight)
    return min(bounds, default=None)


def write_budget(final: storage.Location, options: CheckpointOptions) -> int | None:
    """The bytes of data files a save may have in flight under ``host_memory_limit``: the
    limit over the copies a write to ``final`` makes (``Location.write_copies``)."""
    limit = options.host_memory_limit
    return None if limit is None else limit // final.write_copies


def _explain(coord: cluster.Coordinator, error: BaseException, leader: int | None = None) -> None:
    """Raises the failure of another process that caused ``error``: a lost relay connection
    usually means the other process failed; a write fails once the leader, having given up,
    removed the staging area (writes create no directory). Only reports already made count:
    this process's own error stands when no other process failed."""
    if isinstance(error, relay.RelayConnectionError):
        coord.raise_if_another_failed("save", grace=2.0)
    elif leader is not None and coord.me != leader:
        coord.raise_if_another_failed("save")  # e.g. the leader gave up and removed the staging area


def _remove_staging(staging: storage.Location, final: storage.Location, token: str = "") -> None:
    """Removes an abandoned save's staging area, whole, however late the others are.

    A process that learned its name before the leader gave up may write into it at any time
    (a straggler: the leader timed out on it). Writes create no directory, so once the
    directory is gone they fail; but a file made while it is being removed, after the
    removal listed it, would keep it from going, and leave it behind. So a local staging
    directory is renamed first, to a name no process writes to (a ``.tmp-`` one, which
    ``tpu-ckpt gc`` knows, should this process die meanwhile), and removed under that name."""
    if staging.is_local:
        doomed = final.staging(storage.new_token())
        try:
            os.rename(staging.local_path.rstrip("/"), doomed.local_path)
            staging = doomed
        except FileNotFoundError:
            return  # removed already
        except OSError as error:  # then removed where it is
            logger.warning("tpu_ckpt: could not move the staging area %s aside to remove it: %s", staging.url, error)
    remove_staging(staging, token)  # on an object store: only this save's objects (``token``)


@dataclasses.dataclass(frozen=True)
class OwnFiles:
    """Data files a save copies rather than lays out from arrays (the local tier's upload copies
    a local step's): ``names``, as ``write`` writes them into the staging area (what an abandoned
    save removes), and ``write``, which writes them through the save's ``Writes`` and returns
    this process's index."""

    names: tuple[str, ...]
    write: Callable[[data_writes.Writes], Manifest]


class SaveJob:
    """One planned save being carried out.

    It keeps the plan's manifest for the commit, and owns the data still to be written (the
    plan's arrays, or their host copies once ``snapshot`` ran), which it lets go as soon as
    it is written: an async save's copy is freed before the wait for the other processes,
    and no device buffer is referenced once ``snapshot`` returns.
    """

    def __init__(
        self, plan: SavePlan, final: storage.Location, coord: cluster.Coordinator, leader: int,
        options: CheckpointOptions, staging: Staging, incremental: Incremental | None = None,
        reused: Reused | None = None, own_files: OwnFiles | None = None,
    ):
        self.manifest = plan.manifest
        self.host_digests = plan.host_digests
        self.piece_count = plan.piece_count
        self.final = final
        self.coord = coord
        self.leader = leader  # checks the destination, names the staging area, commits
        self.options = options
        self.staging = staging
        self._unwritten = plan.files
        # An incremental save keeps its index as a manifest (what the next one references);
        # any other keeps it as rows, a few bytes a piece (``data_writes.write_all_encoded``).
        rows_plan = IndexPlan.of(plan.manifest) if incremental is None else None
        self._writes = data_writes.Writes(staging.store, write_budget(final, options), rows_plan)
        self._incremental = incremental
        if reused is not None:
            self._writes.reference(reused.pieces, reused.files)
        self._copied = False  # whether the data to write are host copies of our own
        self._copies = own_files  # files to copy instead of the plan's (which has none then)
        names = (f.name for f in plan.files) if own_files is None else own_files.names
        self._own_files = (
            *names, staged_index_file(coord.me, staging.token), values_file_name(coord.me, staging.token)
        )

    def snapshot(self) -> None:
        """Replaces the data to write by host copies, within ``host_memory_limit``
        (``data_writes.snapshot``)."""
        self._unwritten = data_writes.snapshot(self._unwritten, self._writes.limit, lambda: self._writes)
        self._copied = True

    def run(self) -> None:
        self.write_and_commit()
        self.run_callbacks()

    def write_and_commit(self) -> None:
        started = time.perf_counter()
        coord, store = self.coord, self.staging.store
        hands_off = False  # set once this process may delete nothing any more
        try:
            index, files, kept = self._own_index(store)
            record = per_process.write_values(store, self.manifest, self.host_digests, coord.me, self.staging.token)
            if coord.me == self.leader:
                records = coord.collect("written", record, at=self.leader)
                others = [p for p in range(coord.count) if p != self.leader]
                commit.commit(
                    self.staging.backend, self.final, self._planned(), index, others, coord.progress,
                    self.staging.token, finish=lambda merged: per_process.completed(merged, records, self.host_digests),
                )
                hands_off = True  # committed
                coord.publish("committed")
            else:
                store.write(staged_index_file(coord.me, self.staging.token), [index]).result()
                coord.collect("written", record, at=self.leader)
                # This process has written: the staging area is the leader's to commit or
                # remove. On an object store it is the final prefix, which a late removal here
                # could empty under a manifest the leader already wrote.
                hands_off = True
                coord.receive("committed", self.leader)
        except BaseException as error:
            if self._incremental is not None:
                self._incremental.forget()  # its references may name a step gone or damaged: the next save writes all
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
        if self._incremental is not None and kept is not None:
            self._incremental.committed(self.final, kept)
        if self.options.io_device == coord.me and coord.count > 1 and self._incremental is None:
            # every process's bytes went through this one (an incremental save's fewer)
            relay.note_rate(_job_bytes(self.manifest), time.perf_counter() - started)
        logger.info(
            "tpu_ckpt: saved %s (%d leaves, %d pieces, %d files, %.1f MB from this process) in %.2fs",
            self.final.url, len(self.manifest.leaves), self.piece_count, len(files), sum(files.values()) / 1e6,
            time.perf_counter() - started,
        )

    def write_own(self, store: storage.CheckpointStore) -> Manifest | bytes:
        """Writes this process's data files; returns its index, encoded unless the save is
        incremental. Each file's host bytes go once it is written. A save given ``own_files``
        (the local tier's upload) copies them instead."""
        if self._copies is not None:
            return self._copies.write(self._writes)
        files, self._unwritten = collections.deque(self._unwritten), ()
        if self._incremental is None:
            return data_writes.write_all_encoded(self._writes, files, recycle=self._copied)
        return data_writes.write_all(self._writes, files, recycle=self._copied)

    def _own_index(self, store: storage.CheckpointStore) -> tuple[bytes, dict[str, int], Manifest | None]:
        """Writes this process's data files: its index encoded, its data files' sizes, and
        the index itself where an incremental save keeps it; no other object per piece stays."""
        own = self.write_own(store)
        if isinstance(own, bytes):
            return own, self._writes.sizes, None
        return encode_index(own, IndexPlan.of(self.manifest)), own.files, own if self._incremental is not None else None

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
            _remove_staging(self.staging.location, self.final, self.staging.token)
        else:
            storage.remove_files(self.staging.backend, self._own_files)
            self.staging.close()

    def run_callbacks(self) -> None:
        for callback in path_callbacks(self.options):
            callback(self.final.url)
