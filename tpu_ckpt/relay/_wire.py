"""The relay's wire format, shared by its server (``relay/_server.py``) and client (``relay/_client.py``).

Each message is a 16-byte header (two big-endian uint64: JSON length, payload length), a
JSON object, then the payload bytes. Both ends read through the same few functions so that
every length on the wire is bounded before anything is allocated (``MAX_REQUEST_BYTES``,
``MAX_MESSAGE_BYTES``, ``MAX_FILE_BYTES``), and every socket call moves a bounded chunk, so
the connection's timeout measures progress, never the whole transfer (a ``deadline`` bounds
a whole message where a peer trickling bytes must not hold the reader). Errors cross as
JSON objects, so the client raises the same ``CheckpointError`` subclass the server's
process raised. Every socket of either end goes through :func:`tune` before it carries a byte.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_ckpt import errors, storage
from tpu_ckpt.settings import settings

# one request's JSON: a file name and a few numbers (a read sends its span, not its pieces)
MAX_REQUEST_BYTES = 64 << 10
MAX_MESSAGE_BYTES = 1 << 20  # one answer's JSON: an error's report at most
MAX_FILE_BYTES = 1 << 40  # one file written, or read whole, through the relay
_HEADER = struct.Struct("!QQ")
_CHUNK = 8 << 20  # one bounded socket call: the timeout measures progress, not the whole file

logger = logging.getLogger(__name__)


class RelayConnectionError(errors.CheckpointError):
    """The relay connection failed (refused, reset, timed out): the other process may have
    failed first, which its own report explains better."""


class RelayUnreachableError(RelayConnectionError):
    """No TCP connection to a relay server within ``relay_connect_seconds``: a firewall
    between the hosts, an address the client cannot reach, or a server process gone."""


class RelayBindError(errors.CheckpointError):
    """A relay server cannot listen: every port of ``TPU_CKPT_RELAY_PORTS`` is taken, or the
    relay's address is not one of this host's."""


class RelayRequestError(errors.CheckpointError):
    """The relay refused a request: a file this operation does not serve or accept, or a
    length beyond the relay's bounds. The job's own processes never ask that, so it means a
    bug, or a process of another operation that holds this one's secret."""


class Traffic:
    """What this process's relay moved since it started, for diagnostics (``relay.traffic()``,
    ``benchmarks/control_plane.py``): connections opened (past the handshake) and accepted (the
    secret checked), and bytes sent and received on them, headers included. One lock per socket
    call, which moves up to 8 MiB: nothing next to the call itself."""

    FIELDS = ("opened", "accepted", "sent", "received")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.FIELDS, 0)

    def add(self, field: str, n: int) -> None:
        with self._lock:
            self._counts[field] += n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


TRAFFIC = Traffic()


def traffic() -> dict[str, int]:
    """This process's relay connections opened and accepted, and bytes sent and received, since
    it started (diagnostics: take the difference around an operation)."""
    return TRAFFIC.counts()


def admitted(conn: socket.socket, idle: float) -> None:
    """The server's answer to a client past the handshake (its idle timeout), counted."""
    send(conn, {"ok": True, "idle": idle})
    TRAFFIC.add("accepted", 1)


def tune(conn: socket.socket, buffer_bytes: int) -> None:
    """Sets a relay socket up for bulk transfers, before it carries a byte.

    TCP_NODELAY: a message goes out as two writes (its header, then its payload) and its
    sender then waits for the answer; Nagle's algorithm would hold the second write back
    until the peer's delayed ACK, up to 40 ms a request. Large buffers: one connection
    should fill a data-centre link, whose bandwidth-delay product outgrows the kernel's
    default. A listening socket passes them on to the connections it accepts, and must
    have them before it listens, for the TCP window scale agreed at the handshake."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        granted = (
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        )
        _report_buffers(buffer_bytes, *granted)


def listen(host: str, backlog: int, buffer_bytes: int, where: str) -> socket.socket:
    """A socket listening on the first free port of ``Settings.relay_ports`` (any port when
    unset). The backlog holds every connection the server serves, and those awaiting their
    hello: SYNs a whole pod sends at once must not overflow it, or clients would wait on
    retransmissions."""
    ports = settings().relay_ports
    first, last = ports or (0, 0)
    for port in range(first, last + 1):
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
            tune(listener, buffer_bytes)
            listener.bind((host, port))
            listener.listen(backlog)
            return listener
        except OSError as e:
            listener.close()
            if e.errno != errno.EADDRINUSE or ports is None:
                raise RelayBindError(
                    f"The relay for {where} cannot listen on {host}:{port}: {e}. If {host} is not an address "
                    "of this host, set TPU_CKPT_RELAY_HOST to one the job's other hosts reach it at.",
                    file=where,
                ) from e
    raise RelayBindError(
        f"The relay for {where} cannot listen on {host}: every port of TPU_CKPT_RELAY_PORTS={first}-{last} is "
        "in use. Widen the range (each save or restore through the relay holds a port on every serving "
        "process while it runs) and allow the wider range through the firewall between the job's hosts.",
        file=where,
    )


@functools.cache
def _report_buffers(asked: int, send: int, receive: int) -> None:
    """Once per process and outcome: the kernel silently caps what a socket asks for, and a
    capped buffer caps every relay connection's throughput. Linux grants twice what it is
    asked for, the half beyond for its bookkeeping."""
    if min(send, receive) < (2 * asked if sys.platform == "linux" else asked):
        logger.warning(
            "tpu_ckpt: the kernel granted relay sockets %d-byte send and %d-byte receive buffers of the %d asked "
            "(Settings.relay_socket_buffer_bytes): raise net.core.wmem_max and net.core.rmem_max, or set the "
            "knob to 0 to leave the sizes to the kernel's autotuning", send, receive, asked,
        )
    else:
        logger.info("tpu_ckpt: relay sockets have %d-byte send and %d-byte receive buffers", send, receive)


def send(conn: socket.socket, message: dict[str, Any], payload: Sequence[Any] = ()) -> None:
    views = [memoryview(p).cast("B") for p in payload]
    send_header(conn, message, sum(len(v) for v in views))
    send_payload(conn, views)


def send_header(conn: socket.socket, message: dict[str, Any], payload_size: int) -> None:
    meta = json.dumps(message).encode()
    conn.sendall(_HEADER.pack(len(meta), payload_size) + meta)
    TRAFFIC.add("sent", _HEADER.size + len(meta))


def send_payload(conn: socket.socket, views: Sequence[memoryview]) -> None:
    for view in views:
        for start in range(0, len(view), _CHUNK):
            conn.sendall(view[start : start + _CHUNK])
            TRAFFIC.add("sent", min(_CHUNK, len(view) - start))


def receive_header(
    conn: socket.socket, limit: int = MAX_MESSAGE_BYTES, deadline: float | None = None
) -> tuple[dict[str, Any], int]:
    """A message's JSON object and the length of the payload that follows (which the caller
    bounds before reading it). A malformed or oversized message is a ValueError; one not
    complete by ``deadline`` (``time.monotonic()``), a TimeoutError."""
    head = bytearray(_HEADER.size)
    receive_into(conn, [head], deadline)
    meta_size, payload_size = _HEADER.unpack(head)
    if meta_size > limit:
        raise ValueError(f"a {meta_size}-byte message where at most {limit} may come")
    meta = bytearray(meta_size)
    receive_into(conn, [meta], deadline)
    try:
        message = json.loads(meta)
    except RecursionError:
        raise ValueError("a message nested too deeply") from None
    if not isinstance(message, dict):
        raise ValueError("a message that is not a JSON object")
    return message, payload_size


def receive(conn: socket.socket) -> tuple[dict[str, Any], bytes]:
    """A small message (handshake, queue notices): its payload is bounded like its JSON."""
    message, size = receive_header(conn)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a {size}-byte payload where at most {MAX_MESSAGE_BYTES} may come")
    data = bytearray(size)
    receive_into(conn, [data])
    return message, bytes(data)


def receive_into(conn: socket.socket, buffers: Sequence[Any], deadline: float | None = None) -> None:
    """Fills ``buffers``. The socket's timeout bounds each call; ``deadline`` (when given)
    the whole, so that a peer sending a byte at a time cannot stretch it."""
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while len(view):
            if deadline is not None:
                _until(conn, deadline)
            n = conn.recv_into(view[:_CHUNK])
            if n == 0:
                raise EOFError("the peer closed the connection")
            TRAFFIC.add("received", n)
            view = view[n:]


def _until(conn: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the message was not complete by its deadline")
    conn.settimeout(left)


def receive_chunked(conn: socket.socket, size: int) -> list[np.ndarray]:
    """``size`` payload bytes, in buffers allocated only as bytes arrive: a peer that claims
    much and sends little costs little memory."""
    chunks = []
    while size:
        chunks.append(storage.aligned_empty(min(size, _CHUNK)))
        receive_into(conn, chunks[-1:])
        size -= chunks[-1].nbytes
    return chunks


def discard(conn: socket.socket, size: int) -> None:
    scratch = bytearray(min(size, _CHUNK))
    while size:
        receive_into(conn, [memoryview(scratch)[: min(size, _CHUNK)]])
        size -= min(size, _CHUNK)


def error_to_json(error: BaseException) -> dict[str, Any]:
    if isinstance(error, errors.CheckpointError):
        return {"type": type(error).__name__, "message": str(error), "key": error.key, "file": error.file}
    return {"type": "CheckpointError", "message": f"{type(error).__name__}: {error}", "key": None, "file": None}


def error_from_json(data: Any) -> errors.CheckpointError:
    """The same error type the IO process raised (a plain CheckpointError for the others)."""
    if not isinstance(data, dict):
        data = {"message": f"an unreadable error report: {data!r:.200}"}
    name = str(data.get("type"))
    cls = RelayRequestError if name == RelayRequestError.__name__ else getattr(errors, name, errors.CheckpointError)
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)) or cls in (
        errors.CoordinationTimeoutError,
    ):
        cls = errors.CheckpointError
    key, file = data.get("key"), data.get("file")
    return cls(
        str(data.get("message")),
        key=key if isinstance(key, str) else None,
        file=file if isinstance(file, str) else None,
    )
