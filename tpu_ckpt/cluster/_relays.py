"""One process serving another's reads or writes, wired through the coordinator: the server
publishes its contact at a stage, the client receives it there; where several serve (a
restore's holders and range servers), every contact is exchanged in one step instead
(:func:`contacts`). Every relay of a job (the shared reads of a restore, the local tier's
replicas and restore) is set up this way."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from tpu_ckpt import relay, storage
from tpu_ckpt.cluster._coordinator import Coordinator, relay_host

# The fan-out K of a restore's control plane: the most processes that serve one piece of it or of
# its replicated bytes (range servers, load_and_broadcast's readers), and the most peers one
# process talks to in a tier restore's merge tree (tiers/_merge_tree.py) and relay tree
# (restoring/_shared_reads.py). Their two levels hold K² processes at a per-process cost of
# O(K + N / K), so K is the smallest power of two with K² >= N (a power of two: the merge tree's
# chunks and groups then come out even more often), at least SMALLEST_FANOUT (a job that small
# stays flat: one hop) and at most MAX_SERVERS (docs/scaling.md). Read through fanout() at call
# time, so that a test or a benchmark can fix K in every process (tests/cluster/fanout.py).
SMALLEST_FANOUT = 4
MAX_SERVERS = 64


def fanout(processes: int) -> int:
    """K for a job of ``processes``: the same on every process of it."""
    return min(MAX_SERVERS, max(SMALLEST_FANOUT, 1 << ((max(processes, 1) - 1).bit_length() + 1) // 2))


def serve(coord: Coordinator, stage: str | None, store: Any, peers: int, **options: Any) -> relay.RelayServer:
    """A relay server of ``store`` for ``peers`` processes on this host's address, its contact
    published at ``stage`` (the server closed again if publishing fails; None: not published,
    the caller brings it to :func:`contacts`). ``options``: the server's (``accepts``,
    ``serves``, ``shared``)."""
    server = relay.RelayServer(store, relay_host(), coord.timeout, peers=peers, **options)
    try:
        if stage is not None:
            coord.publish(stage, server.contact())
    except BaseException:
        server.close()
        raise
    return server


def contacts(coord: Coordinator, stage: str, server: relay.RelayServer | None) -> dict[int, str]:
    """Every serving process's contact, exchanged in one step (a ``collect`` at every
    process), each process bringing its ``server``'s or none."""
    found = coord.collect(stage, "" if server is None else server.contact(), at=coord.me)
    return {process: contact for process, contact in found.items() if contact}


def connect(
    coord: Coordinator, stage: str, server: int, location: storage.Location, contact: str | None = None, **options: Any
) -> relay.RelayStore:
    """A client of process ``server``'s relay: ``contact`` when known (:func:`contacts`), else
    the one it published at ``stage``."""
    return relay.RelayStore(location, contact or coord.receive(stage, server), coord.timeout, server, **options)


class Clients:
    """Clients of other processes' relays, one per process and stage, each connected by the
    first thread that asks for it, outside the lock (a restore connects to its peers in
    parallel, and a slow peer holds up only its own callers), all closed together."""

    def __init__(self, coord: Coordinator, location: storage.Location, connections: int):
        self._coord, self._location, self._connections = coord, location, connections
        self._clients: dict[tuple[int, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def get(self, process: int, stage: str, contact: str | None) -> relay.RelayStore:
        """Process ``process``'s client for ``stage``: ``contact`` (:func:`contacts`), or the
        one it published at ``stage`` followed by its number."""
        with self._lock:
            made = (process, stage) not in self._clients
            if made:
                self._clients[process, stage] = concurrent.futures.Future()
            future = self._clients[process, stage]
        if made:
            try:
                client = connect(self._coord, f"{stage}{process}", process, self._location, contact,
                                 connections=self._connections)
            except BaseException as error:
                future.set_exception(error)
                raise
            future.set_result(client)
        return future.result()

    def close(self) -> None:
        with self._lock:
            made = list(self._clients.values())
        for future in made:
            if future.done() and future.exception() is None:
                future.result().close()


def spread(processes: list[int], most: int) -> list[int]:
    """At most ``most`` of ``processes`` (sorted), evenly spaced: the same on every process."""
    if len(processes) <= most:
        return processes
    return [processes[i * len(processes) // most] for i in range(most)]
