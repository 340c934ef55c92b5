"""The local tier of a multi-tier CheckpointManager: frequent saves to each host's own disk.

Object storage is too slow and costly for a checkpoint every few minutes, and a preempted
pod loses the work since its last checkpoint. So each process writes its own pieces (the
data files and the index an ordinary save writes, by ``data_writes.write_all``) to its own
``local_directory``, which no other host sees, and sends copies of those files over the relay
to ``local_replicas`` other processes (``replica_roles``), so that losing a host loses no
piece. What each host's disk holds:

    <local_directory>/step_<s>/               a committed local step, renamed into place
        tier.json                             {"token": the save's id, the same on every host,
                                               "count": the job's process count, "copy": the
                                               processes of this host's slice when each slice
                                               wrote a whole copy (``_slice_copies``), else null,
                                               "step", and the crc32c of this host's plan and
                                               parts' indexes: ``_part_checks``}
        plan.json                             the save's manifest without pieces (every leaf)
        d<p>-<n>.safetensors, index-<p>.bin   the part of each process p this host holds: its
        (values-<p>.bin: ``_local_values``)   own, and those it keeps as a replica
    <local_directory>/step_<s>.tmp-<hex>/     a local save in progress (or interrupted)

A part's index is what an ordinary save's process leaves for the leader (binary rows, ``format.encode_index``), so the
plan and parts covering every process merge into a full manifest as a commit merges them (``saving.merge_rows``). A host
renames its step into place only after a barrier says that every process has written its part and its replicas durably:
a directory ``step_<s>`` holds complete parts only, and a step can be restored when the parts on the hosts still alive
cover every process (``tiers/_restore.py``). A host killed before the rename leaves a ``.tmp-`` leftover, removed by its
next local save, and the previous step stays the newest.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tpu_ckpt import cluster, relay, saving, storage
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import PLAN_FILE, TIER_FILE, IndexPlan, encode_index, staged_index_file, written_by
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.runtime import gc_paused
from tpu_ckpt.saving import WRITER, SavePlan, SaveResult, plan_save
from tpu_ckpt.tiers import _local_values as local_values
from tpu_ckpt.tiers import _part_checks as part_checks
from tpu_ckpt.tiers._hosts import job_hosts
from tpu_ckpt.tiers._placement import check_size
from tpu_ckpt.tiers._replicas import replica_roles
from tpu_ckpt.tiers._slice_copies import copy_group, job_slices

logger = logging.getLogger(__name__)

_COMMITTED = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"step_\d+\.(tmp|old)-[0-9a-f]+")
_proved = cluster.Proved()  # local directories this process has proved are its own (see _prove_private)
_old_warned: set[str] = set()  # local steps of JSON indexes this process has warned of (``_owners``)


@dataclasses.dataclass(frozen=True)
class LocalStep:
    """A committed local step on this host: the save's token, the process count it was
    saved with, and the processes whose parts this host holds (``owners``; ``others``: those
    whose files are of another save, ``_part_checks``)."""

    step: int
    token: str
    count: int
    owners: tuple[int, ...]
    copy: tuple[int, ...] | None = None  # a slice's processes, whose parts make a whole copy (``_slice_copies``)
    others: tuple[int, ...] = ()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")


def held_steps(root: str) -> list[LocalStep]:
    """The committed local steps on this host's disk, oldest first (an unreadable one is
    skipped with a warning: the other hosts may still hold its parts)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _COMMITTED.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(root, name)
        try:
            info = storage.read_json(path, TIER_FILE, 1 << 16)  # no FIFO, device, link out or deep nesting
            step = int(match[1])
            owners = _owners(path)
            others = part_checks.others(path, step, info, owners)
            count = info["count"]
            if type(count) is not int or count < 1:
                raise ValueError(f"{TIER_FILE} gives a process count of {count!r}")
            copy = info.get("copy")
            copy = None if copy is None else tuple(sorted(int(p) for p in copy))
            found.append(
                LocalStep(step, str(info["token"]), count, tuple(sorted(owners - others)), copy, tuple(sorted(others)))
            )
        except (OSError, ValueError, KeyError, TypeError, CheckpointError) as e:
            logger.warning("tpu_ckpt: ignoring the local step %s: %s", path, e)
    return sorted(found, key=lambda s: s.step)


def _owners(path: str) -> set[int]:
    """The processes whose parts the step ``path`` holds: its binary indexes. A step saved
    before parts kept them binary (``index-<p>.json``) holds none a restore reads: it is
    warned of (once), never chosen (the persistent tier serves), and pruned like any other."""
    names = os.listdir(path)
    if path not in _old_warned and any(n.endswith(".json") and written_by(n) is not None for n in names):
        _old_warned.add(path)
        logger.warning(
            "tpu_ckpt: the local step %s was saved by an earlier tpu_ckpt, whose parts' indexes are JSON: "
            "it is not restored from the local tier (a restore takes the persistent tier's steps), and goes "
            "as newer local steps are saved", path,
        )
    return {owner for n in names if (owner := written_by(n)) is not None and n == staged_index_file(owner)}


def save_local(
    root: str, step: int, tree: Any, options: CheckpointOptions, *, replicas: int,
    metrics: dict[str, float | int] | None, then: Callable[[BaseException | None], None],
    max_file_bytes: int | None = None, max_to_keep: int | None = None,
) -> SaveResult:
    """Saves ``tree`` as local step ``step`` on every process (SPMD, like ``tc.save``).

    With ``enable_async`` it returns once the pieces are on the host, and the background
    writer does the rest; under ``host_memory_limit`` as ``tc.save`` does (files that do not
    fit are written first, from the arrays). ``max_file_bytes`` bounds its data files as
    ``save.largest_file`` does the destination's they are uploaded to. ``then`` runs after
    the commit (with None) or the failure (with the error), on the thread that wrote."""
    WRITER.settle()  # one save in flight per process, local or not
    coord = cluster.Coordinator(f"local save of step {step} in {root}", options.coordination_timeout)
    job = None
    try:
        with gc_paused():
            slices = job_slices(coord.count)
            group = copy_group(tree, coord.me, slices)  # each slice writes its own copy: no replica to send
            plan = plan_save(
                tree, options, process_index=coord.me, process_count=coord.count, metrics=metrics,
                max_file_bytes=max_file_bytes, group=group,
            )
            hosts = job_hosts(coord) if replicas and group is None else None  # no replica on the owner's host
            job = _LocalSave(
                root, step, plan, coord, replicas, then, options.host_memory_limit, slices=slices, copy=group,
                hosts=hosts,
            )
            share = sum(f.nbytes for f in plan.files)  # in memory: is the RAM disk big enough?
            check_size(root, share, len(job.keeps), max_to_keep, options.enable_async)
            if options.enable_async:
                job.snapshot()
    except BaseException as error:
        with coord:
            coord.report_failure(error)
            if job is not None:
                job.discard()
        then(error)
        raise
    if not options.enable_async:
        with gc_paused():
            job.run()
        return SaveResult(step_dir(root, step))
    return WRITER.start(step_dir(root, step), job.run)


class _LocalSave:
    """One process's part of a local save: write, replicate, wait for all, commit, and
    receive meanwhile the parts this process keeps for others."""

    def __init__(
        self, root: str, step: int, plan: SavePlan, coord: cluster.Coordinator, replicas: int,
        then: Callable[[BaseException | None], None], limit: int | None = None, *,
        slices: tuple[int | None, ...] | None = None, copy: frozenset[int] | None = None,
        hosts: tuple[int, ...] | None = None,
    ):
        self.root, self.step, self.coord, self.then = root, step, coord, then
        self.planned = plan.manifest
        self._files = plan.files
        self._copied = False  # whether the files' data are host copies of our own
        self._limit = limit  # host_memory_limit
        self._staging = ""  # this process's staging directory, once made (``_open``)
        self._token = ""
        self._store: storage.Backend | None = None
        self._writes: saving.Writes | None = None
        self.copy = copy  # its slice's processes, when each slice writes a copy: the replicas, no TCP copy
        self.sends_to, self.keeps = replica_roles(
            coord.me, 0 if copy else replicas, slices or (None,) * coord.count, hosts
        )

    def snapshot(self) -> None:
        """Host copies of this process's pieces, within ``host_memory_limit``
        (``data_writes.snapshot``): the caller may then donate its buffers."""
        self._files = saving.snapshot(self._files, self._limit, lambda: self._open()[1])
        self._copied = True

    def _open(self) -> tuple[storage.Backend, saving.Writes]:
        """This process's staging directory's store, and its writes, made once (the save's
        token names the directory)."""
        if self._store is None or self._writes is None:
            self._token = self._agreed_token()
            self._staging = os.path.join(self.root, f"step_{self.step}.tmp-{self._token}{self.coord.me:06x}")
            storage.make_directory(self._staging)
            self._store = storage.Store(storage.Location(self._staging))
            self._writes = saving.Writes(self._store, self._limit)
        return self._store, self._writes

    def discard(self) -> None:
        """Removes what this process wrote of a save that failed."""
        if self._store is not None:
            self._store.close()
        if self._staging:
            shutil.rmtree(self._staging, ignore_errors=True)

    def run(self) -> None:
        try:
            self._save()
        except BaseException as error:
            self.then(error)
            raise
        self.then(None)

    def _save(self) -> None:
        coord = self.coord
        try:
            store, writes = self._open()
            with store, self._receiving(store):
                names = self._write(store, writes)
                self._replicate(self._staging, names)
                coord.barrier("stored")  # every part and every replica is on disk, everywhere
            _prove_private(coord, self.root, f"step_{self.step}.tmp-{self._token}", self._staging)
            _commit(self.root, self.step, self._staging, {"token": self._token, "count": coord.count,
                                                           "copy": None if self.copy is None else sorted(self.copy)})
        except BaseException as error:
            coord.report_failure(error)
            self.discard()
            if isinstance(error, relay.RelayConnectionError):  # the peer's own report says more
                coord.raise_if_another_failed("stored", grace=2.0)
            raise
        finally:
            coord.close()

    def _agreed_token(self) -> str:
        """The save's id, the same on every process (process 0's): it names the staging
        directories and marks the committed step, so no step mixes the parts of two saves.
        It starts with process 0's clock: of two whole saves of one step (a host killed before
        its rename keeps the older), the restore takes the larger token, the newer save."""
        if self.coord.me == 0 or self.coord.count == 1:
            token = f"{time.time_ns():016x}{storage.new_token()}"
            self.coord.publish("token", token)
            return token
        return self.coord.receive("token", 0)

    @contextlib.contextmanager
    def _receiving(self, store: storage.Backend) -> Iterator[None]:
        """Receives the parts this process keeps for others into its staging directory,
        accepting only their files; stops (and with it every write into ``store``) on exit,
        before the store closes."""
        server = None
        if self.keeps:
            accepts = lambda name: written_by(name) in self.keeps  # noqa: E731
            server = cluster.serve(self.coord, f"serve{self.coord.me}", store, len(self.keeps), accepts=accepts)
        try:
            yield
        finally:
            if server is not None:
                server.close()

    def _write(self, store: storage.Backend, writes: saving.Writes) -> list[str]:
        """Writes this process's data files, its index and the plan; returns the names of
        its part (the plan is the same on every process: each host keeps its own copy)."""
        files, self._files = collections.deque(self._files), ()
        index = saving.write_all(writes, files, recycle=self._copied)
        name = staged_index_file(self.coord.me)  # binary rows: the tier restore merges them as a commit does
        rows = encode_index(index, IndexPlan.of(self.planned))
        for future in (store.write(name, [rows]), store.write(PLAN_FILE, [self.planned.to_json()])):
            future.result()
        return [*index.files, name, *local_values.write(store, self.planned, self.coord.me, self._token)]

    def _replicate(self, staging: str, names: list[str]) -> None:
        """Sends each written file, read back from the page cache, to every replica holder,
        which writes it durably before answering."""
        peers = []
        try:
            for holder in self.sends_to:
                peer = cluster.connect(self.coord, f"serve{holder}", holder, storage.Location(self.root), connections=2)
                peers.append(peer)
            pending = [peer.write(name, [mapped(staging, name)]) for name in names for peer in peers]
            for future in pending:
                future.result()
        finally:
            for peer in peers:
                peer.close()


def mapped(root: str, name: str) -> Any:
    """File ``name`` of ``root``, opened confined to it (``safe_reads.open_confined``), as
    bytes without a copy in this process's memory (the page cache serves them)."""
    with os.fdopen(storage.open_confined(root, name), "rb") as f:
        return np.memmap(f, dtype=np.uint8, mode="r") if os.fstat(f.fileno()).st_size else b""


def _commit(root: str, step: int, staging: str, info: dict[str, Any]) -> None:
    """Renames the staging directory into place, with the token every process wrote. An
    older save of the same step (a job resumed from before it) is moved aside first: a
    leftover, removed by ``prune``, never a step mixing two saves' parts."""
    try:
        info = {**info, **part_checks.record(staging, step)}  # what ties each part and the plan to this save
        with open(os.path.join(staging, TIER_FILE), "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        final = step_dir(root, step)
        if os.path.exists(final):
            os.rename(final, f"{final}.old-{storage.new_token()}")
        storage.rename_durably(staging, final)
    except OSError as e:
        raise CheckpointError(f"Could not commit the local step {step} in {root}: {e}", file=staging) from e


def _prove_private(coord: cluster.Coordinator, root: str, prefix: str, mine: str) -> None:
    """Refuses, on every process, a ``local_directory`` that several processes see (a shared file system), where their
    commits would replace each other's steps. Checked at the first local save into ``root``: after the barrier every
    process's staging directory of the save exists, and process 0 gathers who sees another's before anyone commits."""
    if root in _proved or coord.count == 1:
        return
    seen = sorted(n for n in os.listdir(root) if n.startswith(prefix) and n != os.path.basename(mine))
    verdict = cluster.agreed_verdict(
        coord, "private", seen[0] if seen else "", lambda views: next((v for _, v in sorted(views.items()) if v), "")
    )
    if verdict:
        raise CheckpointError(
            f"local_directory {root} is shared with other processes of this job (their staging directory "
            f"{verdict} is here): the local tier needs each host's own disk (local SSD, RAM disk). Give each "
            "host a path on its own disk, or leave local_directory out and save to the shared directory.",
            file=root,
        )
    _proved.add(root)


def prune(root: str, keep: int | None, protected: int | None) -> None:
    """Keeps this host's newest ``keep`` local steps (and ``protected``, a step being
    uploaded), and removes the leftovers of interrupted local saves. A step goes by a rename
    to a leftover name first, so an interrupted removal never leaves a step with files missing."""
    steps = [s.step for s in held_steps(root)]
    doomed = [s for s in steps[:-keep] if s != protected] if keep else []
    for step in doomed:
        logger.info("tpu_ckpt: removing the local step %s (local_max_to_keep=%s)", step_dir(root, step), keep)
        os.rename(step_dir(root, step), f"{step_dir(root, step)}.old-{storage.new_token()}")
    for name in os.listdir(root):
        if _LEFTOVER.fullmatch(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
