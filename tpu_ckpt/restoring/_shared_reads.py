"""Where a restore's piece bytes come from: storage, or (load_and_broadcast) another process.

By default every process reads the pieces its devices need, so a replicated leaf is read
once per process: N requests for the same bytes, the herd that keeps a pod waiting on
storage. With ``CheckpointOptions(load_and_broadcast=True)`` every process works out, from
the manifest and the target shardings (which are global), which processes need each piece.
A piece several need is assigned to one of them, balanced by bytes as writes are
(``pieces.WriteBalance``); that process reads it from storage once and the others fetch it
from it over TCP (``relay/_client.py``), checking its crc32c on arrival. Beyond
``cluster.fanout(N)`` processes a piece reaches each other group of that many processes through
a member of the reader's group and one of the other's (:class:`_RelayTree`), so no reader
serves every needer itself and each process talks to its group and about two others.

No process ever waits for another's progress (which could deadlock two processes that need
each other's pieces in different orders): a piece is read at its first request, from a peer
or from its reader's own restore, and kept only until every process that needs it has taken
it. A process that asks again later gets it read again. Memory: the pieces read ahead of the
slowest peer, at most the shared bytes assigned to this process. Every process must restore
the same target, as with any SPMD call.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import LeafEntry, PieceEntry, Read, check_crcs, coalesce, full_slice, overlapping
from tpu_ckpt.sharding import WriteBalance, index_to_slice

PieceId = tuple[str, int]  # (file, offset)
Reads = list[tuple[Read, concurrent.futures.Future]]


class StoreReads:
    """Every piece from storage (or the io_device relay), adjacent ones coalesced."""

    def __init__(self, store: storage.ReadableStore):
        self.store = store

    def start(self, needed: Iterable[tuple[str, PieceEntry]]) -> Reads:
        """Issues the reads of ``(leaf key, piece)`` pairs; crc32c is checked in the IO threads."""
        return [(r, self._read(r)) for r in coalesce(needed)]

    def _read(self, r: Read) -> concurrent.futures.Future:
        check = functools.partial(check_crcs, self.store.location.child(r.file), r)
        return self.store.read(r.file, r.start, r.lengths(), then=check)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The pieces several processes need: who reads each, and who needs it."""

    readers: dict[PieceId, int]
    needers: dict[PieceId, frozenset[int]]


def plan(wants: Sequence[tuple[LeafEntry, jax.sharding.Sharding | None]], process_count: int) -> Plan:
    """Assigns each piece needed by several processes to one of them (every process computes
    the same plan), of at most K = ``cluster.fanout(process_count)`` evenly spaced ones: a piece
    the whole job needs is served by at most K processes, so each connects to O(K) peers.
    A target without sharding (numpy, Python scalar) is wanted whole by all."""
    balance = WriteBalance()
    most = cluster.fanout(process_count)
    readers, needers = {}, {}
    everyone = frozenset(range(process_count))
    for leaf, sharding in wants:
        need: dict[PieceId, set[int]] = {}
        for region, processes in _regions(leaf, sharding, everyone).items():
            for piece in overlapping(leaf, region):
                need.setdefault((piece.file, piece.offset), set()).update(processes)
        for piece in leaf.pieces:
            processes = need.get((piece.file, piece.offset), set())
            if len(processes) > 1 and piece.length > 0:
                reader = balance.assign(cluster.spread(sorted(processes), most), piece.length)
                readers[(piece.file, piece.offset)] = reader
                needers[(piece.file, piece.offset)] = frozenset(processes)
    return Plan(readers, needers)


def _regions(leaf: LeafEntry, sharding: jax.sharding.Sharding | None, everyone: frozenset[int]) -> dict[Any, set[int]]:
    if sharding is None:
        return {full_slice(leaf.shape): set(everyone)}
    regions: dict[Any, set[int]] = {}
    device: jax.Device  # jaxlib's own type has no stubs
    for device, index in sharding.devices_indices_map(leaf.shape).items():
        region = full_slice(leaf.shape) if index is None else index_to_slice(index, leaf.shape)
        regions.setdefault(region, set()).add(device.process_index)
    return regions


class SharedReads(StoreReads):
    """Reads the pieces this process reads for everyone, and fetches the others' from them."""

    def __init__(
        self, store: storage.CheckpointStore, coord: cluster.Coordinator, the_plan: Plan,
        pieces: dict[PieceId, tuple[str, PieceEntry]], keep_bytes: int | None = None,
    ):
        super().__init__(store)
        self.coord = coord
        self.plan = the_plan
        self._tree = _RelayTree(coord.count, cluster.fanout(coord.count), tuple(sorted(set(the_plan.readers.values()))))
        self._peers = cluster.Clients(coord, store.location, connections=2)
        self._contacts: dict[int, str] = {}
        self._exchanged = threading.Event()  # a relayer may be asked before its own collect returns
        mine = {pid: pieces[pid] for pid, reader in the_plan.readers.items() if reader == coord.me}
        needers = {pid: self._tree.takers(coord.me, the_plan.needers[pid]) for pid in mine}
        relayed = self._tree.relayed(coord.me, the_plan)
        keep = keep_bytes if keep_bytes is None or not (mine and relayed) else keep_bytes // 2  # the two share it
        self._cache = _ReadOnce(self._read_stored, mine, needers, keep, store.location)
        self._relayed = _ReadOnce(self._fetch_upstream, {pid: pieces[pid] for pid in relayed}, relayed, keep,
                                  store.location)
        serving = mine or relayed
        self._server = cluster.serve(coord, None, store, coord.count - 1, shared=self._take) if serving else None
        try:
            self._contacts = cluster.contacts(coord, "readers", self._server)  # one step, whoever serves
        except BaseException:
            self.close()
            raise
        finally:
            self._exchanged.set()

    def start(self, needed: Iterable[tuple[str, PieceEntry]]) -> Reads:
        own: list[tuple[str, PieceEntry]] = []
        shared: list[tuple[str, PieceEntry]] = []
        for key, piece in needed:
            (shared if (piece.file, piece.offset) in self.plan.readers else own).append((key, piece))
        reads = super().start(own)
        for key, piece in {(p.file, p.offset): (k, p) for k, p in shared}.values():
            r, check = self._checked(key, piece)
            reads.append((r, self._shared(piece, check)))
        return reads

    def finish(self) -> None:
        """Waits until every process has its pieces (they may still need this one's), then closes."""
        try:
            self.coord.barrier("restored")
        finally:
            self.close()

    def close(self) -> None:
        """Stops serving and fetching (on failure: the others learn it from the coordinator)."""
        if self._server is not None:
            self._server.close()
        self._peers.close()

    def _shared(self, piece: PieceEntry, check: Callable[[list[Any]], Any]) -> concurrent.futures.Future:
        source = self._tree.source(self.coord.me, self.plan.readers[(piece.file, piece.offset)])
        if source == self.coord.me or self._relayed.holds((piece.file, piece.offset)):
            return self._take(piece.file, piece.offset, self.coord.me)
        return self._from(source, piece, check)

    def _take(self, file: str, offset: int, process: int) -> concurrent.futures.Future:
        """A piece this process reads or relays, for ``process``."""
        cache = self._relayed if self._relayed.holds((file, offset)) else self._cache
        return cache.take(file, offset, process)

    def _checked(self, key: str, piece: PieceEntry) -> tuple[Read, Callable[[list[Any]], Any]]:
        """The read of one whole piece, and the check of its crc32c on arrival."""
        r = Read(piece.file, piece.offset, piece.offset + piece.length, ((key, piece),))
        return r, functools.partial(check_crcs, self.store.location.child(piece.file), r)

    def _read_stored(self, key: str, piece: PieceEntry) -> concurrent.futures.Future:
        return self.store.read(piece.file, piece.offset, [piece.length], then=self._checked(key, piece)[1])

    def _fetch_upstream(self, key: str, piece: PieceEntry) -> concurrent.futures.Future:
        """A piece this process relays to its group or sends to other groups, from upstream."""
        upstream = self._tree.upstream(self.coord.me, self.plan.readers[(piece.file, piece.offset)])
        return self._from(upstream, piece, self._checked(key, piece)[1])

    def _from(self, process: int, piece: PieceEntry, check: Callable[[list[Any]], Any]) -> concurrent.futures.Future:
        """The piece ``process`` reads or relays for this one."""
        return self._peer(process).shared_piece(piece.file, piece.offset, piece.length, self.coord.me, check)

    def _peer(self, process: int) -> relay.RelayStore:
        self._exchanged.wait(self.coord.timeout)  # else the contact is missing and the connection fails, named
        return self._peers.get(process, "serve", self._contacts.get(process))


@dataclasses.dataclass(frozen=True)
class _RelayTree:
    """Beyond ``fanout`` processes, the processes are cut into groups of ``fanout`` (by process
    index). A piece goes from its reader to its own group's needers, and to each other group
    that needs it in two more hops: a *sender* of the reader's group passes it to that group's
    *relayer*, which passes it to the group. Senders and relayers are picked by the other
    group's distance and the reader's rank, so each member passes a reader's pieces on to about
    one other group and relays for about one reader: every process connects to its own group
    and to about two others, O(fanout) peers up to fanout² processes (where one reader serving
    a relayer per group would be O(fanout + N / fanout)). Within ``fanout``: one group, every
    piece from its reader."""

    count: int
    fanout: int
    readers: tuple[int, ...]  # every reader of the plan, sorted: the same on every process

    @functools.cached_property
    def _rank(self) -> dict[int, int]:
        return {reader: n for n, reader in enumerate(self.readers)}

    def _group(self, process: int) -> int:
        return process // self.fanout if self.count > self.fanout else 0

    def _members(self, group: int) -> range:
        return range(group * self.fanout, min(self.count, (group + 1) * self.fanout))

    def relayer(self, reader: int, group: int) -> int:
        """The member of ``group`` that fetches ``reader``'s pieces for it: by the reader's rank,
        so that a group's relayers differ (readers are evenly spaced: their numbers would not)."""
        members = self._members(group)
        return members[self._rank[reader] % len(members)]

    def sender(self, reader: int, group: int) -> int:
        """The member of ``reader``'s group that passes its pieces to ``group``'s relayer (maybe
        the reader itself)."""
        own = self._group(reader)
        members, distance = self._members(own), (group - own) % -(-self.count // self.fanout)
        return members[(distance - 1 + self._rank[reader]) % len(members)]

    def source(self, me: int, reader: int) -> int:
        """Where ``me`` fetches a piece ``reader`` reads, unless it relays or sends it itself."""
        group = self._group(me)
        return reader if group == self._group(reader) else self.relayer(reader, group)

    def upstream(self, me: int, reader: int) -> int:
        """Where ``me`` fetches a piece ``reader`` reads that it relays or sends on."""
        group = self._group(me)
        return reader if group == self._group(reader) else self.sender(reader, group)

    def takers(self, reader: int, needers: frozenset[int]) -> frozenset[int]:
        """Who takes a piece from its ``reader``: its needers of the reader's group, and the
        sender (or where the reader is the sender, the relayer) for each other group."""
        own = self._group(reader)
        out: set[int] = set()
        for group in {self._group(p) for p in needers}:
            if group == own:
                out.update(p for p in needers if self._group(p) == own)
            else:
                sender = self.sender(reader, group)
                out.add(self.relayer(reader, group) if sender == reader else sender)
        return frozenset(out)

    def relayed(self, me: int, plan: Plan) -> dict[PieceId, frozenset[int]]:
        """The pieces ``me`` fetches to pass on (as a relayer, to its group's needers; as a
        sender, to other groups' relayers), each with who takes it from ``me`` (``me`` too, if
        it needs it)."""
        if self.count <= self.fanout:
            return {}
        group, out = self._group(me), {}
        for pid, reader in plan.readers.items():
            needers, own = plan.needers[pid], self._group(reader)
            if own != group and self.relayer(reader, group) == me:
                takers = frozenset(p for p in needers if self._group(p) == group)
            elif own == group and me != reader:
                takers = frozenset(self.relayer(reader, g) for g in self._sent(me, reader)
                                   if any(p in needers for p in self._members(g)))
                takers = takers | ({me} & needers) if takers else takers
            else:
                continue
            if takers:
                out[pid] = takers
        return out

    def _sent(self, me: int, reader: int) -> Iterable[int]:
        """The groups ``me`` passes ``reader``'s pieces to (:meth:`sender`, inverted)."""
        own = self._group(reader)
        members, groups = self._members(own), -(-self.count // self.fanout)
        first = (me - members[0] - self._rank[reader]) % len(members) + 1
        return ((own + distance) % groups for distance in range(first, groups, len(members)))


class _ReadOnce:
    """The pieces this process reads (or relays) for several: each fetched at its first
    request and kept until every process that takes it from here has, or, beyond
    ``keep_bytes`` of them (``host_memory_limit``), until newer ones push it out: a peer that
    asks for it later gets it fetched again, which costs a read where waiting could deadlock."""

    def __init__(
        self, fetch: Callable[[str, PieceEntry], concurrent.futures.Future],
        pieces: dict[PieceId, tuple[str, PieceEntry]], needers: dict[PieceId, frozenset[int]],
        keep_bytes: int | None, location: storage.Location,
    ):
        self._fetch = fetch
        self._pieces = pieces
        self._needers = needers
        self._keep_bytes = keep_bytes
        self._location = location
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[PieceId, tuple[concurrent.futures.Future, set[int]]] = (
            collections.OrderedDict()
        )
        self._held_bytes = 0
        self._given_out: set[PieceId] = set()

    def holds(self, pid: PieceId) -> bool:
        return pid in self._pieces

    def take(self, file: str, offset: int, process: int) -> concurrent.futures.Future:
        pid = (file, offset)
        if pid not in self._pieces:
            raise CheckpointError(
                f"process {process} asked this process for the piece at {file}:{offset}, which the "
                "load_and_broadcast plan did not give it; do all processes restore the same target?",
                file=self._location.child(file),
            )
        first, future = False, concurrent.futures.Future[Any]()
        with self._lock:
            if pid in self._given_out:  # asked again after everyone had it: fetch it again
                first = True
            else:
                if pid not in self._held:
                    first = True
                    self._held[pid] = (future, set())
                    self._held_bytes += self._pieces[pid][1].length
                future, taken = self._held[pid]
                taken.add(process)
                if taken >= self._needers[pid]:
                    self._drop(pid)
                    self._given_out.add(pid)
                while self._keep_bytes is not None and self._held_bytes > self._keep_bytes and len(self._held) > 1:
                    self._drop(next(iter(self._held)))  # the oldest
        if first:  # fetched outside the lock: a relayer's first fetch from a reader connects to it
            _settle(future, self._fetch, *self._pieces[pid])
        return future

    def _drop(self, pid: PieceId) -> None:
        del self._held[pid]
        self._held_bytes -= self._pieces[pid][1].length


def _settle(future: concurrent.futures.Future, fetch: Callable[..., concurrent.futures.Future], *args: Any) -> None:
    """``future`` completed as ``fetch(*args)``'s is, or with what ``fetch`` raised."""
    try:
        fetched = fetch(*args)
    except BaseException as error:
        future.set_exception(error)
        raise

    def settle(done: concurrent.futures.Future) -> None:
        error = done.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(done.result())

    fetched.add_done_callback(settle)
