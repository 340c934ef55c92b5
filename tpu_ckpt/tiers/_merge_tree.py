"""A local step's merge at any job size: each process talks to O(K) peers, K = ``cluster.fanout(N)``,
N the processes reading the copy (the job, or one slice of it).

Range server ``r`` (``_range_merge``) needs range ``r``'s rows of every part of its copy, one blob per part at the
part's holder, and every member of the copy needs every range's manifest and the table rows of its own cells. Pulled
directly, range server ``r`` opens a connection to every holder and accepts one from every member: O(N) each, ~3,000
at 1,536 hosts. Beyond K members the merge is a tree of fan-out K, both ways (:class:`MergeTree`, plain data that
every process computes alike):

- up: the holders are cut into chunks of K; for range ``r`` and chunk ``c`` one member, the *gatherer*, reads range
  ``r``'s blobs of the chunk's parts from their holders and serves them to range server ``r``, which reads from one
  gatherer per chunk (:func:`gathered`);
- down: the members are cut into groups of K; for range ``r`` and group ``g`` one member of the group, the
  *relayer*, serves the group range ``r``'s manifest and forwards their reads of its piece tables to range server
  ``r``, which serves one relayer per group (:func:`relayed`).

A process then opens and accepts at most about K connections of each role, and a role falls on a process about
N / members times; two levels serve K² processes before a chunk count passes K: K is the smallest power of two
with K² >= N (16 at 200 processes, 64 at 1,536), up to 64 (4,096 processes). Where one chunk holds every holder or
one group every member (N <= K), gatherer and relayer are the range server itself: the flat merge, and no extra step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence

from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import MANIFEST_FILE, decode_manifest
from tpu_ckpt.tiers._held_files import InMemory, Routed

Read = Callable[[str], bytes | None]


@dataclasses.dataclass(frozen=True)
class MergeTree:
    """Who gathers and who relays each range of one copy's merge."""

    members: tuple[int, ...]  # the processes reading this copy, in order; range r's server is members[r]
    ranges: int
    holders: tuple[int, ...]  # the processes serving the copy's parts, sorted
    fanout: int

    @classmethod
    def of(cls, members: Sequence[int], ranges: int, holders: Sequence[int]) -> MergeTree:
        """The tree of one copy's merge: its size, not the job's, sets K (a slice copy's members
        are one slice's processes)."""
        return cls(tuple(members), ranges, tuple(sorted(set(holders))), cluster.fanout(len(members)))

    @functools.cached_property
    def _chunk(self) -> dict[int, int]:
        return {holder: n // self.fanout for n, holder in enumerate(self.holders)}

    @functools.cached_property
    def _place(self) -> dict[int, int]:
        return {process: n for n, process in enumerate(self.members)}

    @property
    def chunks(self) -> int:
        return -(-len(self.holders) // self.fanout)

    @property
    def groups(self) -> int:
        return -(-len(self.members) // self.fanout)

    def range_of(self, process: int) -> int | None:
        """The range ``process`` serves, if any."""
        place = self._place.get(process)
        return place if place is not None and place < self.ranges else None

    def chunk_of(self, holder: int) -> int:
        return self._chunk[holder]

    def gatherer(self, r: int, chunk: int) -> int:
        """The member that reads range ``r``'s blobs of ``chunk``'s parts for its server."""
        if self.chunks == 1:
            return self.members[r]
        return self.members[(chunk * self.ranges + r) % len(self.members)]

    def group(self, process: int) -> tuple[int, ...]:
        """The members of ``process``'s group."""
        first = self._place[process] // self.fanout * self.fanout
        return self.members[first : first + self.fanout]

    def relayer(self, r: int, process: int) -> int:
        """The member of ``process``'s group that serves it range ``r`` (group 0's: the server)."""
        group = self.group(process)
        return group[r % len(group)]

    def gathers(self, process: int) -> list[tuple[int, int]]:
        """The (range, chunk) pairs ``process`` gathers for a server other than itself."""
        if self.chunks == 1:
            return []
        return [(r, c) for r in range(self.ranges) for c in range(self.chunks)
                if self.gatherer(r, c) == process != self.members[r]]

    def relays(self, process: int) -> list[int]:
        """The ranges ``process`` relays to its group, for a server other than itself."""
        if process not in self._place:
            return []
        return [r for r in range(self.ranges) if self.relayer(r, process) == process != self.members[r]]


def gathered(
    tree: MergeTree, me: int, blobs: Callable[[int, int], list[str]], parts: storage.ReadableStore
) -> dict[str, bytes]:
    """The blobs this process gathers for other range servers (``blobs(r, chunk)``: their
    names), each read from its holder through ``parts``, 8 at a time."""
    names = [name for r, chunk in tree.gathers(me) for name in blobs(r, chunk)]
    return read_all(names, parts.read_file, parts.location)


def read_all(names: Sequence[str], read: Read, location: storage.Location) -> dict[str, bytes]:
    """``names`` of the local step at ``location``, read 8 at a time; a missing one is a
    CorruptCheckpointError naming it."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        found = dict(zip(names, pool.map(read, names)))
    out = {}
    for name, data in found.items():
        if data is None:
            raise CorruptCheckpointError(f"{location.child(name)} is missing", file=location.url)
        out[name] = data
    return out


def relayed(
    coord: cluster.Coordinator, tree: MergeTree, location: storage.Location,
    upstream: Callable[[int], storage.ReadableStore], serving: contextlib.ExitStack,
) -> tuple[storage.ReadableStore | None, relay.RelayServer | None]:
    """The ranges this process relays to its group, and their server: each range's manifest,
    read once from its server (``upstream(r)``: a client of it), and the reads of its piece
    tables forwarded there. (None, None) where it relays none."""
    ranges = tree.relays(coord.me)
    if not ranges:
        return None, None
    manifests: dict[str, bytes] = {}
    routes: dict[str, storage.ReadableStore] = {}
    serves: dict[str, int | None] = {}
    for r in ranges:
        source = upstream(r)
        body = source.read_file(MANIFEST_FILE)
        if body is None:
            raise CorruptCheckpointError(f"the merged manifest of range {r} is missing from its server",
                                         file=location.url)
        tables = decode_manifest(body, where=f"the merged manifest of {location.url} (range {r})").tables
        manifests[relayed_manifest(r)] = body
        routes.update({name: source for name in tables})
        serves.update({relayed_manifest(r): None, **tables})
    store = _Forwarding(location, InMemory(location, manifests), routes)
    server = cluster.serve(coord, None, store, len(tree.group(coord.me)) - 1, serves=serves)
    serving.callback(server.close)
    return store, server


def relayed_manifest(r: int) -> str:
    """The name range ``r``'s manifest has at its relayer (one relayer may serve several ranges)."""
    return f"range-{r:05d}-{MANIFEST_FILE}"


class _Forwarding(Routed):
    """Ranges' manifests held in memory, and their piece tables' reads forwarded to the range
    servers that hold them (a group member reads only the rows of its own cells)."""

    def __init__(self, location: storage.Location, manifests: InMemory, routes: dict[str, storage.ReadableStore]):
        self.location = location
        self._manifests = manifests
        self._routes = routes

    def _store_of(self, name: str) -> storage.ReadableStore:
        if name in self._manifests.sizes:
            return self._manifests
        if name not in self._routes:
            raise CorruptCheckpointError(f"{self.location.child(name)} is not a file of the ranges relayed here",
                                         file=name)
        return self._routes[name]

    def close(self) -> None:
        """Nothing to release: the clients are closed by the restore."""
