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

import concurrent.futures
import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.catalog import OpenCheckpoint, store_tables
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    PER_PROCESS,
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
from tpu_ckpt.tiers import _merge_tree as merge_tree
from tpu_ckpt.tiers import _part_checks as part_checks
from tpu_ckpt.tiers import _range_merge as range_merge
from tpu_ckpt.tiers._choice import Choice
from tpu_ckpt.tiers._held_files import InMemory, Layered, Routed


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
    parts = {owner: holders[owner] for owner in owners}
    store = _Parts(own, parts, coord, choice.token)
    with contextlib.ExitStack() as serving:  # servers stop first, then the stores close
        serving.callback(store.close)
        try:
            mine = [o for o, h in holders.items() if h == coord.me]
            data, planned, ranges = _plan_and_serve(coord, store, own, mine, len(members), choice, serving)
            tree = merge_tree.MergeTree.of(members, len(ranges), list(parts.values()))
            manifest = _agreed_manifest(coord, store, data, planned, parts, tree, ranges, serving)
            readers, copies = _fill_from(choice, coord.count)
            tree, _, nbytes = restore_from(
                OpenCheckpoint(store, manifest), target, options, None, coord if readers or copies else None,
                readers=readers, copies=copies,
            )
            coord.barrier("restored")  # serves until everyone has what it needs
        except BaseException as error:
            coord.report_failure(error)
            if isinstance(error, relay.RelayConnectionError):  # the peer's own report says more
                coord.raise_if_another_failed("restore", grace=2.0)
            raise
    return tree, nbytes


def _fill_from(choice: Choice, count: int) -> tuple[frozenset[int] | None, tuple[frozenset[int], ...] | None]:
    """How the leaves replicated across processes are completed, by one collective over the
    mesh's replica axes (``restoring/_fanout.py``; a leaf it cannot serve goes over the relay
    as before): of slice copies where some process's slice lost its copy, the first whole
    copy's processes read for everyone (the readers); where every slice has its own, each
    slice's processes read for their slice (the copies); (None, None) without copies."""
    if not choice.copies:
        return None, None
    if all(any(p in copy for copy in choice.copies) for p in range(count)):
        return None, tuple(frozenset(copy) for copy in choice.copies)
    return frozenset(choice.copies[0]), None


def _plan_and_serve(
    coord: cluster.Coordinator, store: _Parts, own: storage.Backend, mine: list[int], readers: int, choice: Choice,
    serving: contextlib.ExitStack,
) -> tuple[bytes, Manifest, list[tuple[int, int]]]:
    """The step's plan, decoded, and the ranges of leaves that the ``readers`` of this
    process's copy merge (at most ``cluster.fanout(readers)``). A process serving parts
    (``mine``) reads the plan from its own disk, cuts its parts' rows by range and serves
    them; then every server's contact is exchanged in one step (``cluster.contacts``); a
    process serving none reads the plan from its copy's first holder."""
    server, step = None, choice.local_step or 0
    if mine:
        data, planned, ranges = _plan(store, readers)
        parts = part_checks.check_step(own.location.local_path, step, choice.token, data)
        blobs = range_merge.part_blobs(own, mine, IndexPlan.of(planned), ranges, parts, step)
        if any(leaf.kind == PER_PROCESS for leaf in planned.leaves):  # each part's values record, for its merger
            blobs.update({range_merge.record_name(o): local_values.read_record(own, o) for o in mine})
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
    return data, planned, range_merge.leaf_ranges(len(planned.leaves), min(readers, cluster.fanout(readers)))


def _serve(
    coord: cluster.Coordinator, own: storage.Backend, parts: list[int], held: Layered, peers: int,
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
    coord: cluster.Coordinator, store: _Parts, plan: bytes, planned: Manifest, parts: dict[int, int],
    tree: merge_tree.MergeTree, ranges: list[tuple[int, int]], serving: contextlib.ExitStack,
) -> Manifest:
    """Process ``tree.members[r]`` merges range ``r``'s rows of every part (``parts``: owner ->
    holder) and serves that range's manifest and piece tables (:func:`_merged_range`); every
    process reads each range's manifest (one entry per leaf), 8 at a time, and joins them, then
    loads, lazily, the piece-table rows of its own cells, checked as any manifest's. Beyond
    ``cluster.fanout(N)`` processes the rows go up and the ranges come down through the merge
    tree's gatherers and relayers (``_merge_tree``). No process reads more of the parts' rows
    than its range's, nor holds an object per piece of the job."""
    view = _Ranges(coord, store, parts, tree, serving)
    if not view.flat:
        valued = {r for r, (first, stop) in enumerate(ranges)
                  if any(leaf.kind == PER_PROCESS for leaf in planned.leaves[first:stop])}
        gathered = merge_tree.gathered(tree, coord.me, functools.partial(_blobs, tree, parts, valued), store)
        view.exchange("gathered", _serve_held(coord, InMemory(store.location, gathered),
                                               len({r for r, _ in tree.gathers(coord.me)}), serving))
    index, server = tree.range_of(coord.me), None
    if index is not None:
        view.own, server = _merged_range(coord, store, plan, view.blob, index, ranges)
        if server is not None:
            serving.callback(server.close)
    view.exchange("ranges", server)
    if not view.flat:
        view.relayed, relayer = merge_tree.relayed(coord, tree, store.location, view.upstream, serving)
        view.exchange("relayed", relayer)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        parts_of = list(pool.map(view.manifest_of, range(len(ranges))))
    return range_merge.joined(planned, parts_of, ranges, view.where)


def _serve_held(
    coord: cluster.Coordinator, held: InMemory, peers: int, serving: contextlib.ExitStack
) -> relay.RelayServer | None:
    """A server of ``held`` to ``peers`` processes; None where it holds nothing."""
    if not held.sizes:
        return None
    server = cluster.serve(coord, None, held, peers, serves=dict(held.sizes))
    serving.callback(server.close)
    return server


class _Ranges:
    """Where this process reads each range's rows and manifest: its own disk and servers, or
    the other processes' (one client per process and stage, opened at first use and closed
    with the restore), as the merge tree says."""

    def __init__(
        self, coord: cluster.Coordinator, store: _Parts, parts: dict[int, int], tree: merge_tree.MergeTree,
        serving: contextlib.ExitStack,
    ):
        self._coord, self._store, self._parts, self._tree = coord, store, parts, tree
        self.flat = coord.count <= cluster.fanout(coord.count)  # the same everywhere: whether the tree steps run
        self.own: storage.ReadableStore | None = None  # the range this process serves
        self.relayed: storage.ReadableStore | None = None  # the ranges it relays to its group
        self.where = f"the merged manifest of {store.location.url}"
        self._contacts: dict[str, dict[int, str]] = {}
        self._clients = cluster.Clients(coord, store.location, connections=1)
        serving.callback(self._clients.close)  # the tables are read while the restore plans

    def exchange(self, stage: str, server: relay.RelayServer | None) -> None:
        """Every server's contact at ``stage``, in one step (collective)."""
        self._contacts[stage] = cluster.contacts(self._coord, stage, server)

    def blob(self, name: str) -> bytes | None:
        """A range's blob of a part, for its server: from the part's holder, or its gatherer."""
        owner, me, r = range_merge.blob_owner(name), self._coord.me, self._tree.range_of(self._coord.me)
        holder = None if owner is None else self._parts.get(owner)  # None: the store names it, of no part here
        chunk = None if self.flat or holder is None or r is None else self._tree.chunk_of(holder)
        via = me if chunk is None or r is None else self._tree.gatherer(r, chunk)
        return self._store.read_file(name) if via == me else self._client(via, "gathered").read_file(name)

    def upstream(self, r: int) -> storage.ReadableStore:
        """Range ``r``'s server."""
        if self._tree.members[r] == self._coord.me and self.own is not None:
            return self.own
        return self._client(self._tree.members[r], "ranges")

    def manifest_of(self, r: int) -> Manifest:
        """Range ``r``'s manifest, its tables read lazily from where it came from."""
        held, name = self._source(r)
        data = held.read_file(name)
        if data is None:
            raise CorruptCheckpointError(f"{self.where} is missing from range {r}'s server",
                                         file=self._store.location.url)
        return decode_manifest(data, where=f"{self.where} (leaves of range {r})", tables=store_tables(held))

    def _source(self, r: int) -> tuple[storage.ReadableStore, str]:
        relayer = self._tree.relayer(r, self._coord.me)
        if relayer == self._tree.members[r]:
            return self.upstream(r), MANIFEST_FILE
        if relayer == self._coord.me and self.relayed is not None:
            return self.relayed, merge_tree.relayed_manifest(r)
        return self._client(relayer, "relayed"), merge_tree.relayed_manifest(r)

    def _client(self, process: int, stage: str) -> relay.RelayStore:
        return self._clients.get(process, stage, self._contacts[stage].get(process))


def _blobs(tree: merge_tree.MergeTree, parts: dict[int, int], valued: set[int], r: int, chunk: int) -> list[str]:
    """Range ``r``'s blobs of the parts whose holders are in ``chunk``, and their values
    records where ``r`` is the range holding the per-process leaves (one of ``valued``)."""
    owners = [owner for owner, holder in parts.items() if tree.chunk_of(holder) == chunk]
    records = [range_merge.record_name(owner) for owner in owners] if r in valued else []
    return [range_merge.blob_name(owner, r) for owner in owners] + records


def _merged_range(
    coord: cluster.Coordinator, store: _Parts, plan: bytes, blob: Callable[[str], bytes | None], index: int,
    ranges: list[tuple[int, int]],
) -> tuple[InMemory, relay.RelayServer | None]:
    """Range ``index`` of leaves merged from every part's rows of it (``blob``: read from their
    holders or gatherers, 8 at a time: ``range_merge.merge_range``), and its server to the others."""
    names = [range_merge.blob_name(owner, index) for owner in store.owners]
    read = list(merge_tree.read_all(names, blob, store.location).items())
    body, tables = range_merge.merge_range(
        plan, read, store.location, ranges[index], table_prefix=f"r{index:05d}-",
        finish=lambda merged: local_values.with_values(  # the per-process values' pieces
            lambda p: blob(range_merge.record_name(p)), merged, store.token, store.location),
    )
    source = InMemory(store.location, {MANIFEST_FILE: body, **tables})
    if coord.count == 1:
        return source, None
    serves = {MANIFEST_FILE: None, **{name: len(data) for name, data in tables.items()}}
    return source, cluster.serve(coord, None, source, coord.count - 1, serves=serves)


class _Parts(Routed):
    """The files of one local step across the job: each read goes to the process that
    serves its part (``Choice.holders``), this one's disk or a peer's relay."""

    def __init__(self, own: storage.Backend, holders: dict[int, int], coord: cluster.Coordinator, token: str):
        self.location = own.location
        self._own = own
        self._holders = holders
        self._coord = coord
        self._held: storage.ReadableStore = own
        self._peers = cluster.Clients(coord, own.location, connections=2)
        self.contacts: dict[int, str] = {}  # the holders' servers (``cluster.contacts``)
        self.token = token  # the save being restored (``Choice.token``): its values files must name it

    @property
    def owners(self) -> list[int]:
        """The parts read through this store, by their owners."""
        return list(self._holders)

    def hold(self, blobs: dict[str, bytes]) -> Layered:
        """This host's files from now on: its disk, and ``blobs`` (its parts' rows cut by
        range) in memory; returned to be served to the others."""
        self._held = Layered(self._own, InMemory(self.location, blobs))
        return self._held

    def close(self) -> None:
        self._peers.close()
        self._own.close()

    def _store_of(self, name: str) -> storage.ReadableStore:
        """The store holding ``name``: its part's server; the plan from this process when it
        serves a part of this save, else from one of the holders picked by process number (a
        slice that lost its disks reads it from every holder alike, not all from one)."""
        owner = written_by(name)
        if owner is None:
            owner = range_merge.blob_owner(name)
        if name == PLAN_FILE:
            serving = sorted(set(self._holders.values()))
            holder: int | None = self._coord.me if self._coord.me in serving else serving[self._coord.me % len(serving)]
        else:
            holder = None if owner is None else self._holders.get(owner)
        if holder is None:
            raise CorruptCheckpointError(
                f"{self.location.child(name)} belongs to no part of this local step", file=name
            )
        if holder == self._coord.me:
            return self._held
        return self._peers.get(holder, "serve", self.contacts.get(holder))
