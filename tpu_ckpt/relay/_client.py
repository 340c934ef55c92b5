"""Bytes between hosts: io_device's storage relay, and load_and_broadcast's shared pieces.

With ``CheckpointOptions(io_device=k)`` a checkpoint may live on process k's local disk,
which no other host can see. Process k runs a ``relay_server.RelayServer`` next to its own
storage backend; every other process uses a :class:`RelayStore` in its place, the same
``storage.CheckpointStore``, so save and restore run the same code either way. On save the
others send their data files (and their index) to process k; on restore they ask it for
exactly the byte ranges their devices need and check every piece's crc32c themselves, so
the transfer is covered by the checksum too. ``restoring/_shared_reads.py`` uses the same server and
client for pieces one process reads for several (``shared_piece``).

Bytes go host to host over plain TCP (``relay/_wire.py``): no device collectives (they can
deadlock against a training step running on another thread, and asynchronous saves run on
a background thread), and no coordination-service values (meant for small values, and they
would route every byte through process 0). The address and a per-operation secret travel
through the coordination service's key-value store, which only the job's processes can
read; a connection without the secret is dropped. The secret keeps out other jobs and
accidents on the network (a stale process, a scanner, a misdirected connection); it is no
defence against an attacker who can read the job's traffic, which goes in the clear,
message by message unauthenticated. Every socket operation is bounded by
``coordination_timeout``, so a dead peer is an error, never a hang; connecting is bounded
far shorter (``relay_connect_seconds``), so a firewall between the hosts is an error naming
the host and port to open within seconds, at the first relayed operation. What even a peer
holding the secret can reach is bounded by the server (``relay/_server.py``).
"""

from __future__ import annotations

import concurrent.futures
import math
import queue
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpu_ckpt import errors, storage
from tpu_ckpt.relay import _wire as relay_wire
from tpu_ckpt.settings import settings
from tpu_ckpt.storage import IOPool, PooledStore


class RelayStore(PooledStore, storage.CheckpointStore):
    """Stands in for the storage backend on every process but the IO process."""

    def __init__(
        self, loc: storage.Location, contact: str, timeout: float, server_process: int,
        connections: int | None = None,
    ):
        connections = settings().relay_connections if connections is None else connections
        self.location = loc
        self.server_process = server_process
        self._contact = contact
        self._timeout = timeout
        self._idle = math.inf  # the server's idle timeout, learnt at the handshake
        self._connections: queue.SimpleQueue = queue.SimpleQueue()  # (connection, when last used)
        self._opened: list[socket.socket] = []  # closed at close() even if a caller still has one checked out
        try:
            for _ in range(connections):
                self._connections.put((self._connect(), time.monotonic()))
        except relay_wire.RelayConnectionError:
            self._close_connections()
            raise
        self._pool = IOPool(connections)

    def close(self) -> None:
        super().close()
        self._close_connections()

    def _close_connections(self) -> None:
        for conn in self._opened:
            conn.close()

    def _connect(self) -> socket.socket:
        """A new connection, past the server's handshake."""
        address, secret = self._contact.split(" ")
        conn = self._open(address)
        try:
            relay_wire.send(conn, {"secret": secret})
            answer = relay_wire.receive(conn)[0]
            if not answer.get("ok"):
                refusal = answer.get("error")
                raise EOFError(refusal.get("message") if isinstance(refusal, dict) else "the handshake was refused")
            idle = answer.get("idle")
            self._idle = float(idle) if isinstance(idle, (int, float)) and idle > 0 else math.inf
            relay_wire.TRAFFIC.add("opened", 1)
            return conn
        except (OSError, EOFError, ValueError) as e:
            raise relay_wire.RelayConnectionError(
                f"Could not connect to process {self.server_process} at {address} for {self.location.url}: {e}. "
                "Check that process's log.",
                file=self.location.url,
            ) from e

    def _open(self, address: str) -> socket.socket:
        """A TCP connection to the server, tuned. Connecting has its own short timeout: a
        firewall drops packets silently, and learning it only after ``coordination_timeout``
        would read as a dead host, with nothing said about which port to open."""
        host, port = address.rsplit(":", 1)
        host = host.strip("[]")
        knobs = settings()
        limit = min(knobs.relay_connect_seconds, self._timeout)
        try:
            family, kind, proto, _, target = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
            conn = socket.socket(family, kind, proto)
            self._opened.append(conn)
            relay_wire.tune(conn, knobs.relay_socket_buffer_bytes)
            conn.settimeout(limit)
            conn.connect(target)
        except OSError as e:
            why = self._unreachable(address, host, limit, e)
            raise relay_wire.RelayUnreachableError(why, file=self.location.url) from e
        conn.settimeout(self._timeout)
        return conn

    def _unreachable(self, address: str, host: str, limit: float, error: OSError) -> str:
        ports = settings().relay_ports
        to_open = (
            f"TCP ports {ports[0]}-{ports[1]} (TPU_CKPT_RELAY_PORTS)" if ports else
            "any TCP port, as the relay listens on one the OS picks (or set TPU_CKPT_RELAY_PORTS, "
            "e.g. 50100-50199, on every host and allow just that range)"
        )
        process = self.server_process
        return (
            f"Could not reach process {process}'s relay at {address} for {self.location.url} within "
            f"{limit:g}s: {error}. The likely cause is a firewall between the hosts: allow ingress from the "
            f"job's hosts to {to_open}. If {host} is not an address of process {process}'s host that this host "
            "can reach, set TPU_CKPT_RELAY_HOST on that host. If that process failed, its own report says why."
        )

    def _checkout(self) -> socket.socket:
        """A free connection; one idle for half the server's idle timeout is replaced first,
        before the server closes it under a request."""
        conn, last_used = self._connections.get()
        if time.monotonic() - last_used < self._idle / 2:
            return conn
        conn.close()
        try:
            return self._connect()
        except relay_wire.RelayConnectionError:
            self._connections.put((conn, -math.inf))  # the next call tries again
            raise

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        views = [storage.byte_view(b) for b in buffers]
        return self._pool.submit(self._call, {"op": "write", "name": name}, views, None)

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        """The server reads, this process checks (``then``). The server is sent only the
        span: how it splits into pieces is this process's bookkeeping, not the server's."""
        return self._receive_chunks({"op": "read", "name": name, "start": start, "length": sum(lengths)}, lengths, then)

    def shared_piece(
        self, name: str, offset: int, length: int, requester: int, then: Callable[[list[np.ndarray]], Any]
    ) -> concurrent.futures.Future:
        """One piece the server's process reads for everyone (load_and_broadcast)."""
        request = {"op": "piece", "name": name, "offset": offset, "process": requester}
        return self._receive_chunks(request, [length], then)

    def _receive_chunks(
        self, request: dict[str, Any], lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None
    ) -> concurrent.futures.Future:
        def receive() -> list[np.ndarray]:
            return self._call(request, [], lengths)[1]

        return self._pool.submit(receive, then=then)

    def read_file(self, name: str) -> bytes | None:
        answer, data = self._call({"op": "read_file", "name": name}, [], None)
        return None if answer.get("missing") else data

    def _call(self, request: dict[str, Any], payload: Sequence[memoryview], lengths: Sequence[int] | None) -> Any:
        """One request and its answer on a free connection: the answer, and its payload as
        fresh arrays of ``lengths`` when given (received into, no copy), else as bytes. The
        arrays are allocated only once the server answered: it checks a read against its
        file's real size first, so a manifest claiming a 1 TiB piece costs no allocation here.

        A connection that failed mid-message is closed before it goes back to the pool: its
        stream is out of step, and a later request must fail, not read an old answer."""
        conn = self._checkout()
        try:
            _send_request(conn, request, payload)
            answer, size = relay_wire.receive_header(conn)
            if "error" in answer:
                relay_wire.discard(conn, size)
                raise relay_wire.error_from_json(answer["error"])
            if lengths is not None:
                if size != sum(lengths):
                    raise EOFError(f"the answer has {size} bytes, not the {sum(lengths)} asked for")
                chunks = [storage.aligned_empty(n) for n in lengths]
                relay_wire.receive_into(conn, chunks)
                return answer, chunks
            if size > relay_wire.MAX_FILE_BYTES:
                raise ValueError(f"the answer claims {size} bytes, more than the relay's {relay_wire.MAX_FILE_BYTES}")
            return answer, b"".join(chunk.data for chunk in relay_wire.receive_chunked(conn, size))
        except errors.CheckpointError:
            raise  # the server's answer: the stream is in step
        except (OSError, EOFError, ValueError) as e:
            conn.close()
            raise relay_wire.RelayConnectionError(
                f"Lost the connection to process {self.server_process} during {request['op']} "
                f"{request.get('name', '')} of {self.location.url}: {e}. Check that process's log.",
                file=self.location.child(request.get("name", "")),
            ) from e
        finally:
            self._connections.put((conn, time.monotonic()))


def _send_request(conn: socket.socket, request: dict[str, Any], payload: Sequence[memoryview]) -> None:
    """A write's payload follows the server's go-ahead (``RelayServer._await_write_slot`` in
    ``relay/_server.py``); a refused write gets an error instead, and sends nothing."""
    if request["op"] != "write":
        relay_wire.send(conn, request)
        return
    relay_wire.send_header(conn, request, sum(len(v) for v in payload))
    go = relay_wire.receive(conn)[0]
    while go.get("wait"):
        go = relay_wire.receive(conn)[0]
    if "error" in go:
        raise relay_wire.error_from_json(go["error"])
    relay_wire.send_payload(conn, payload)
