"""Restoring a multi-tier CheckpointManager: the newest step that some tier holds whole.

The processes first agree on the step and on who serves each part (``_choice``). The merge of the plan and the parts'
indexes (binary rows) into a format 2 manifest and its piece tables is spread over the job (``_range_merge``): each
part's holder cuts its parts' rows by range of leaves, process ``r`` merges range ``r`` and serves its manifest and
tables, and each process joins the ranges' manifests (``_agreed_manifest``). A local restore then reads through
:class:`_Parts`, a store that sends each data file's reads to its holder: this host's disk, or another host over the
relay. The ordinary restore plan and executor do the rest, so a different mesh or process count works as from any
checkpoint, and every piece is checked against its crc32c wherever it came from.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np

from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.catalog import OpenCheckpoint, store_tables
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    PLAN_FILE,
    IndexPlan,
    Manifest,
    decode_manifest,
    written_by,
)
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restoring import restore_from
from tpu_ckpt.tiers import _local_steps as local_steps
from tpu_ckpt.tiers import _local_values as local_values
from tpu_ckpt.tiers import _part_checks as part_checks
from tpu_ckpt.tiers import _range_merge as range_merge
from tpu_ckpt.tiers._choice import Choice


def restore_local(
    coord: cluster.Coordinator, root: str, choice: Choice, target: Any, options: CheckpointOptions,
) -> tuple[Any, int]:
    """Restores the chosen local step of the save ``choice.token``, each part from its server
    in ``choice.holders``, each holder's files checked against that save (``_part_checks``)
    (collective); returns the tree and the bytes read. Of slice copies, each process reads
    one copy's parts (``Choice.reads``), merged by the processes reading the same copy."""
    step, holders = choice.local_step or 0, choice.holders
    owners, members = choice.reads(coord.me, coord.count)
    own = storage.Store(storage.Location(local_steps.step_dir(root, step)))
    store = _Parts(own, {owner: holders[owner] for owner in owners}, coord, choice.token)
    with contextlib.ExitStack() as serving:  # servers stop first, then the stores close
        serving.callback(store.close)
        try:
            mine = [o for o, h in holders.items() if h == coord.me]
            data, planned, ranges = _plan_and_serve(coord, store, own, mine, len(members), choice, serving)
            manifest = _agreed_manifest(coord, store, data, planned, owners, members[: len(ranges)], ranges, serving)
            readers = _fill_from(choice, coord.count)
            tree, _, nbytes = restore_from(
                OpenCheckpoint(store, manifest), target, options, None, coord if readers else None, readers=readers
            )
            coord.barrier("restored")  # serves until everyone has what it needs
        except BaseException as error:
            coord.report_failure(error)
            if isinstance(error, relay.RelayConnectionError):  # the peer's own report says more
                coord.raise_if_another_failed("restore", grace=2.0)
            raise
    return tree, nbytes


def _fill_from(choice: Choice, count: int) -> frozenset[int] | None:
    """Of slice copies where some process's slice lost its copy, the first whole copy's
    processes: they read, and one collective over the mesh's replica axes fills everyone
    (``restoring/_fanout.py``; a leaf it cannot serve goes over the relay as before). None
    (each slice reads its own copy, or there are no copies) otherwise."""
    if not choice.copies or all(any(p in copy for copy in choice.copies) for p in range(count)):
        return None
    return frozenset(choice.copies[0])


def _plan_and_serve(
    coord: cluster.Coordinator, store: _Parts, own: storage.Backend, mine: list[int], readers: int, choice: Choice,
    serving: contextlib.ExitStack,
) -> tuple[bytes, Manifest, list[tuple[int, int]]]:
    """The step's plan, decoded, and the ranges of leaves that the ``readers`` of this
    process's copy merge (at most ``cluster.MAX_SERVERS``). A process serving parts
    (``mine``) reads the plan from its own disk, cuts its parts' rows by range and serves
    them; then every server's contact is exchanged in one step (``cluster.contacts``); a
    process serving none reads the plan from its copy's first holder."""
    server, step = None, choice.local_step or 0
    if mine:
        data, planned, ranges = _plan(store, readers)
        parts = part_checks.check_step(own.location.local_path, step, choice.token, data)
        blobs = range_merge.part_blobs(own, mine, IndexPlan.of(planned), ranges, parts, step)
        server = _serve(coord, own, mine, store.hold(blobs), readers - 1)
        if server is not None:
            serving.callback(server.close)
    store.contacts = cluster.contacts(coord, "serve", server)
    return (data, planned, ranges) if mine else _plan(store, readers)


def _plan(store: _Parts, readers: int) -> tuple[bytes, Manifest, list[tuple[int, int]]]:
    data = store.read_file(PLAN_FILE)
    if data is None:
        raise CorruptCheckpointError(f"{store.location.child(PLAN_FILE)} is missing", file=store.location.url)
    planned = decode_manifest(data, where=store.location.child(PLAN_FILE), tiled=False)
    return data, planned, range_merge.leaf_ranges(len(planned.leaves), min(readers, cluster.MAX_SERVERS))


def _serve(
    coord: cluster.Coordinator, own: storage.Backend, parts: list[int], held: _Layered, peers: int,
) -> relay.RelayServer | None:
    """A server of the files of the parts assigned to this process, and their rows cut by
    range (``held``: the disk and those rows), and nothing else, to ``peers`` processes."""
    if not parts or peers == 0:
        return None
    root = own.location.local_path
    names = [n for n in os.listdir(root) if written_by(n) in parts or n == PLAN_FILE]
    serves = {n: os.lstat(os.path.join(root, n)).st_size for n in names}  # a link's own size: its reads are refused
    serves.update(held.sizes)
    return cluster.serve(coord, None, held, peers, serves=serves)


def _agreed_manifest(
    coord: cluster.Coordinator, store: _Parts, plan: bytes, planned: Manifest, owners: list[int],
    mergers: list[int], ranges: list[tuple[int, int]], serving: contextlib.ExitStack,
) -> Manifest:
    """Process ``mergers[r]`` merges range ``r``'s rows of every part of ``owners`` and
    serves that range's manifest and piece tables (:func:`_merged_range`); every process
    reads each range's manifest (one entry per leaf), 8 at a time, and joins them, then
    loads, lazily, the piece-table rows of its own cells from their range's server, checked
    as any manifest's. No process reads more of the parts' rows than its range's, nor holds
    an object per piece of the job."""
    index = mergers.index(coord.me) if coord.me in mergers else None
    own, server = _merged_range(coord, store, plan, owners, index, ranges) if index is not None else (None, None)
    if server is not None:
        serving.callback(server.close)
    contacts = cluster.contacts(coord, "ranges", server)

    def connect(merger: int) -> storage.ReadableStore:
        if merger == coord.me and own is not None:
            return own
        client = cluster.connect(coord, f"range{merger}", merger, store.location, contacts.get(merger), connections=1)
        serving.callback(client.close)  # the tables are read while the restore plans
        return client

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        servers = list(pool.map(connect, mergers))
    where = f"the merged manifest of {store.location.url}"

    def manifest_of(index: int) -> Manifest:
        data = servers[index].read_file(MANIFEST_FILE)
        if data is None:
            raise CorruptCheckpointError(f"{where} is missing from process {index}", file=store.location.url)
        return decode_manifest(data, where=f"{where} (leaves of process {index})", tables=store_tables(servers[index]))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return range_merge.joined(planned, list(pool.map(manifest_of, range(len(ranges)))), ranges, where)


def _merged_range(
    coord: cluster.Coordinator, store: _Parts, plan: bytes, owners: list[int], index: int,
    ranges: list[tuple[int, int]],
) -> tuple[_InMemory, relay.RelayServer | None]:
    """Range ``index`` of leaves merged from every part's rows of it (read from their
    holders, 8 at a time: ``range_merge.merge_range``), and its server to the others."""
    blobs = [range_merge.blob_name(owner, index) for owner in owners]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        found = dict(zip(blobs, pool.map(store.read_file, blobs)))
    read = [(name, data) for name, data in found.items() if data is not None]
    if len(read) < len(blobs):
        missing = next(name for name, data in found.items() if data is None)
        raise CorruptCheckpointError(f"{store.location.child(missing)} is missing", file=store.location.url)
    body, tables = range_merge.merge_range(
        plan, read, store.location, ranges[index], table_prefix=f"r{index:05d}-",
        finish=lambda merged: local_values.with_values(store, merged, store.token),  # the per-process values' pieces
    )
    source = _InMemory(store.location, {MANIFEST_FILE: body, **tables})
    if coord.count == 1:
        return source, None
    serves = {MANIFEST_FILE: None, **{name: len(data) for name, data in tables.items()}}
    return source, cluster.serve(coord, None, source, coord.count - 1, serves=serves)


class _ReadOnly(storage.ReadableStore):
    """A store a restore reads through and nothing writes to; ``with`` closes it."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _InMemory(_ReadOnly):
    """Files held in memory (the merged manifest and its piece tables), for a relay server
    to serve: whole, or by byte range."""

    def __init__(self, location: storage.Location, files: dict[str, bytes]):
        self.location = location
        self._files = files

    def read_file(self, name: str) -> bytes | None:
        return self._files.get(name)

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Each file's size (the files never change: a holder asks for every read)."""
        return {name: len(data) for name, data in self._files.items()}

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        data, chunks = self._files[name], []
        for n in lengths:
            chunks.append(np.frombuffer(data, np.uint8, n, start).copy())
            start += n
        if then is not None:
            then(chunks)
        future.set_result(chunks)
        return future

    def close(self) -> None:
        """Nothing to release: the bytes are the caller's."""


class _Routed(_ReadOnly):
    """A store that sends each read to the store holding the file (:meth:`_store_of`)."""

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        return self._store_of(name).read(name, start, lengths, then)

    def read_file(self, name: str) -> bytes | None:
        return self._store_of(name).read_file(name)

    @abc.abstractmethod
    def _store_of(self, name: str) -> storage.ReadableStore:
        """The store holding ``name``."""


class _Layered(_Routed):
    """The files of ``memory`` (this host's parts' rows cut by range), else those of ``own``
    (its disk): what a part's holder serves."""

    def __init__(self, own: storage.Backend, memory: _InMemory):
        self.location = own.location
        self._own = own
        self._memory = memory

    @property
    def sizes(self) -> dict[str, int]:
        """The sizes of the files held in memory."""
        return self._memory.sizes

    def _store_of(self, name: str) -> storage.ReadableStore:
        return self._memory if name in self._memory.sizes else self._own

    def close(self) -> None:
        """Nothing to release: both stores are the caller's."""


class _Parts(_Routed):
    """The files of one local step across the job: each read goes to the process that
    serves its part (``Choice.holders``), this one's disk or a peer's relay."""

    def __init__(self, own: storage.Backend, holders: dict[int, int], coord: cluster.Coordinator, token: str):
        self.location = own.location
        self._own = own
        self._holders = holders
        self._coord = coord
        self._held: storage.ReadableStore = own
        self._peers: dict[int, relay.RelayStore] = {}
        self._lock = threading.Lock()
        self.contacts: dict[int, str] = {}  # the holders' servers (``cluster.contacts``)
        self.token = token  # the save being restored (``Choice.token``): its values files must name it

    def hold(self, blobs: dict[str, bytes]) -> _Layered:
        """This host's files from now on: its disk, and ``blobs`` (its parts' rows cut by
        range) in memory; returned to be served to the others."""
        self._held = _Layered(self._own, _InMemory(self.location, blobs))
        return self._held

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._own.close()

    def _store_of(self, name: str) -> storage.ReadableStore:
        """The store holding ``name``: its part's server; the plan from this process when it
        serves a part of this save, else from the server of process 0's part."""
        owner = written_by(name)
        if owner is None:
            owner = range_merge.blob_owner(name)
        if name == PLAN_FILE:
            first = self._holders[min(self._holders)]
            holder: int | None = self._coord.me if self._coord.me in self._holders.values() else first
        else:
            holder = None if owner is None else self._holders.get(owner)
        if holder is None:
            raise CorruptCheckpointError(
                f"{self.location.child(name)} belongs to no part of this local step", file=name
            )
        if holder == self._coord.me:
            return self._held
        with self._lock:
            if holder not in self._peers:
                self._peers[holder] = cluster.connect(
                    self._coord, f"serve{holder}", holder, self.location, self.contacts.get(holder), connections=2
                )
            return self._peers[holder]
