"""Where a restore's piece bytes come from: storage, or (load_and_broadcast) another process.

By default every process reads the pieces its devices need, so a replicated leaf is read
once per process: N requests for the same bytes, the herd that keeps a pod waiting on
storage. With ``CheckpointOptions(load_and_broadcast=True)`` every process works out, from
the manifest and the target shardings (which are global), which processes need each piece.
A piece several need is assigned to one of them, balanced by bytes as writes are
(``pieces.WriteBalance``); that process reads it from storage once and the others fetch it
from it over TCP (``relay/_client.py``), checking its crc32c on arrival.

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
from collections.abc import Iterable, Sequence
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
    the same plan), of at most ``cluster.fanout()`` evenly spaced ones: a piece the whole
    job needs is served by a constant number of processes, so each connects to O(1) peers.
    A target without sharding (numpy, Python scalar) is wanted whole by all."""
    balance = WriteBalance()
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
                readers[(piece.file, piece.offset)] = balance.assign(cluster.spread(sorted(processes)), piece.length)
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
        mine = {pid: pieces[pid] for pid, reader in the_plan.readers.items() if reader == coord.me}
        self._cache = _ReadOnce(store, mine, the_plan.needers, keep_bytes)
        self._server = cluster.serve(coord, None, store, coord.count - 1, shared=self._cache.take) if mine else None
        self._contacts = cluster.contacts(coord, "readers", self._server)  # one step, whoever serves
        self._peers: dict[int, relay.RelayStore] = {}
        self._lock = threading.Lock()

    def start(self, needed: Iterable[tuple[str, PieceEntry]]) -> Reads:
        own: list[tuple[str, PieceEntry]] = []
        shared: list[tuple[str, PieceEntry]] = []
        for key, piece in needed:
            (shared if (piece.file, piece.offset) in self.plan.readers else own).append((key, piece))
        reads = super().start(own)
        for key, piece in {(p.file, p.offset): (k, p) for k, p in shared}.values():
            r = Read(piece.file, piece.offset, piece.offset + piece.length, ((key, piece),))
            reads.append((r, self._shared(r, piece)))
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
        for peer in self._peers.values():
            peer.close()

    def _shared(self, r: Read, piece: PieceEntry) -> concurrent.futures.Future:
        reader = self.plan.readers[(piece.file, piece.offset)]
        if reader == self.coord.me:
            return self._cache.take(piece.file, piece.offset, self.coord.me)
        check = functools.partial(check_crcs, self.store.location.child(r.file), r)
        return self._peer(reader).shared_piece(piece.file, piece.offset, piece.length, self.coord.me, check)

    def _peer(self, process: int) -> relay.RelayStore:
        with self._lock:
            if process not in self._peers:
                # only of the peers it reads from
                contact = self._contacts.get(process)
                self._peers[process] = cluster.connect(
                    self.coord, f"serve{process}", process, self.store.location, contact, connections=2
                )
            return self._peers[process]


class _ReadOnce:
    """The pieces this process reads for several: each read at its first request and kept
    until every process that needs it has taken it, or, beyond ``keep_bytes`` of them
    (``host_memory_limit``), until newer ones push it out: a peer that asks for it later
    gets it read again, which costs a read where waiting could deadlock."""

    def __init__(
        self, store: storage.CheckpointStore, pieces: dict[PieceId, tuple[str, PieceEntry]],
        needers: dict[PieceId, frozenset[int]], keep_bytes: int | None = None,
    ):
        self._store = store
        self._pieces = pieces
        self._needers = needers
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[PieceId, tuple[concurrent.futures.Future, set[int]]] = (
            collections.OrderedDict()
        )
        self._held_bytes = 0
        self._given_out: set[PieceId] = set()

    def take(self, file: str, offset: int, process: int) -> concurrent.futures.Future:
        pid = (file, offset)
        if pid not in self._pieces:
            raise CheckpointError(
                f"process {process} asked this process for the piece at {file}:{offset}, which the "
                "load_and_broadcast plan did not give it; do all processes restore the same target?",
                file=self._store.location.child(file),
            )
        with self._lock:
            if pid in self._given_out:  # asked again after everyone had it: read it again
                return self._read(pid)
            if pid not in self._held:
                self._held[pid] = (self._read(pid), set())
                self._held_bytes += self._pieces[pid][1].length
            future, taken = self._held[pid]
            taken.add(process)
            if taken >= self._needers[pid]:
                self._drop(pid)
                self._given_out.add(pid)
            while self._keep_bytes is not None and self._held_bytes > self._keep_bytes and len(self._held) > 1:
                self._drop(next(iter(self._held)))  # the oldest
        return future

    def _drop(self, pid: PieceId) -> None:
        del self._held[pid]
        self._held_bytes -= self._pieces[pid][1].length

    def _read(self, pid: PieceId) -> concurrent.futures.Future:
        key, piece = self._pieces[pid]
        r = Read(piece.file, piece.offset, piece.offset + piece.length, ((key, piece),))
        check = functools.partial(check_crcs, self._store.location.child(piece.file), r)
        return self._store.read(piece.file, piece.offset, [piece.length], then=check)
