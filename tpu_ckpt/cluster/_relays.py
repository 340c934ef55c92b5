"""One process serving another's reads or writes, wired through the coordinator: the server
publishes its contact at a stage, the client receives it there. Every relay of a job (the
shared reads of a restore, the local tier's replicas and restore) is set up this way."""

from __future__ import annotations

from typing import Any

from tpu_ckpt import relay, storage
from tpu_ckpt.cluster._coordinator import Coordinator, relay_host


def serve(coord: Coordinator, stage: str, store: Any, peers: int, **options: Any) -> relay.RelayServer:
    """A relay server of ``store`` for ``peers`` processes on this host's address, its contact
    published at ``stage`` (the server closed again if publishing fails). ``options``: the
    server's (``accepts``, ``serves``, ``shared``)."""
    server = relay.RelayServer(store, relay_host(), coord.timeout, peers=peers, **options)
    try:
        coord.publish(stage, server.contact())
    except BaseException:
        server.close()
        raise
    return server


def connect(coord: Coordinator, stage: str, server: int, location: storage.Location, **options: Any) -> relay.RelayStore:
    """A client of process ``server``'s relay, whose contact it published at ``stage``."""
    return relay.RelayStore(location, coord.receive(stage, server), coord.timeout, server, **options)
