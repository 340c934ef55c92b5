"""Bytes between hosts: io_device's storage relay, and load_and_broadcast's shared pieces.

With ``CheckpointOptions(io_device=k)`` a checkpoint may live on process k's local disk,
which no other host can see. Process k runs a :class:`RelayServer` next to its own
``storage.Store``; every other process uses a :class:`RelayStore` in its place, with the
same ``write``/``read``/``read_file`` calls, so save and restore run the same code either
way. On save the others send their data files (and their index) to process k; on restore
they ask it for exactly the byte ranges their devices need and check every piece's crc32c
themselves, so the transfer is covered by the checksum too. ``shared_reads.py`` uses the
same server and client for pieces one process reads for several (``shared_piece``).

Bytes go host to host over plain TCP: no device collectives (they can deadlock against a
training step running on another thread, and asynchronous saves run on a background
thread), and no coordination-service values (meant for small values, and they would route
every byte through process 0). The address and a per-operation secret travel through the
coordination service's key-value store, which only the job's processes can read; a
connection without the secret is dropped. The secret keeps out other jobs and accidents on
the network (a stale process, a scanner, a misdirected connection); it is no defence
against an attacker who can read the job's traffic, which goes in the clear, message by
message unauthenticated. Every socket operation is bounded by ``coordination_timeout``, so
a dead peer is an error, never a hang.

Even a peer holding the secret reaches only what its operation needs, and cannot exhaust
the server: a server serves only the files its operation registered (a restore: the
manifest and the data files it lists) and accepts only the names the operation's other
processes write (a save: their data files and index); every length on the wire is bounded
before anything is allocated (``MAX_MESSAGE_BYTES``, ``MAX_FILE_BYTES``, a ranged read
inside its file's registered size), and a write's bytes are allocated as they arrive. At
most ``(peers + 1) * CONNECTIONS_PER_CLIENT`` connections are served at once, and one
silent for the idle timeout is closed; a client reconnects before using a connection idle
for half of it. A refused request gets a :class:`RelayRequestError` naming the file.

Wire format: each message is a 16-byte header (two big-endian uint64: JSON length, payload
length), a JSON object, then the payload bytes.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import queue
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tpu_ckpt import errors, read_plan, storage
from tpu_ckpt.format import ALIGNMENT

logger = logging.getLogger(__name__)

CONNECTIONS_PER_CLIENT = 4
MAX_WRITES_IN_FLIGHT = 4  # files the server holds in memory at once, across all clients
HEARTBEAT_SECONDS = 5.0  # while a write waits for a slot, the server says so this often
MAX_MESSAGE_BYTES = 16 << 20  # one message's JSON: a read of 64 MiB of tiny pieces lists ~2M lengths
MAX_FILE_BYTES = 1 << 40  # one file written, or read whole, through the relay
MAX_RANGES = 2 * read_plan.MAX_READ_BYTES // ALIGNMENT  # one read's pieces and the gaps between them
_MAX_HELLO_BYTES = 1 << 16  # what an unauthenticated peer may make the server read
_HEADER = struct.Struct("!QQ")
_CHUNK = 8 << 20  # one bounded socket call: the timeout measures progress, not the whole file
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # one file in the checkpoint's directory


class RelayConnectionError(errors.CheckpointError):
    """The relay connection failed (refused, reset, timed out): the other process may have
    failed first, which its own report explains better."""


class RelayRequestError(errors.CheckpointError):
    """The relay refused a request: a file this operation does not serve or accept, or a
    length beyond the relay's bounds. The job's own processes never ask that, so it means a
    bug, or a process of another operation that holds this one's secret."""


class RelayServer:
    """Serves one storage location (a checkpoint or its staging area) to the other processes.

    ``serves`` maps the files peers may read to their size (None: read whole only), and
    ``accepts`` says which plain file names they may write; ``shared`` answers
    load_and_broadcast's piece requests, checking them against its plan. ``peers`` is the
    number of processes that connect, which bounds the connections served at once.

    Errors raised while serving go back to the caller, which re-raises them as the same
    ``CheckpointError`` subclass.
    """

    def __init__(
        self, store: storage.Store, host: str, timeout: float, *, peers: int,
        serves: Mapping[str, int | None] | None = None,
        accepts: Callable[[str], bool] = lambda name: False,
        shared: Callable[[str, int, int], concurrent.futures.Future] | None = None,
        idle_timeout: float | None = None,
        write_slots: int = MAX_WRITES_IN_FLIGHT, heartbeat: float = HEARTBEAT_SECONDS,
    ):
        self.store = store
        self.secret = secrets.token_hex(16)
        self._timeout = timeout
        self._idle = timeout if idle_timeout is None else idle_timeout
        self._serves = dict(serves or {})
        self._accepts = accepts
        self._shared = shared  # load_and_broadcast: (file, offset, requester) -> the piece's bytes
        self._max_connections = (peers + 1) * CONNECTIONS_PER_CLIENT  # room for one stray or reconnecting peer
        self._write_slots = threading.BoundedSemaphore(write_slots)
        self._heartbeat = heartbeat
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self.address = f"[{host}]:{self._listener.getsockname()[1]}" if ":" in host else f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._handlers: dict[socket.socket, threading.Thread] = {}  # open connections only
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="tpu_ckpt relay", daemon=True)
        self._acceptor.start()

    def contact(self) -> str:
        """What the other processes need to connect: ``"<host>:<port> <secret>"``."""
        return f"{self.address} {self.secret}"

    def close(self) -> None:
        """Stops serving. Returns once no handler can touch storage any more, so a failed
        save may then remove its staging area without a late write recreating files in it."""
        with self._lock:
            self._closed = True
            handlers = dict(self._handlers)
        _shutdown(self._listener)  # wakes the blocked accept(); close() alone does not
        self._listener.close()
        for conn in handlers:
            _shutdown(conn)
        self._acceptor.join()  # every handler it registered is started by now
        for handler in handlers.values():
            handler.join()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._handlers) >= self._max_connections
                if not full:
                    handler = threading.Thread(target=self._serve, args=(conn,), name="tpu_ckpt relay", daemon=True)
                    self._handlers[conn] = handler
            if full:
                logger.warning("tpu_ckpt: refused a relay connection from %s: %d already open", peer, self._max_connections)
                conn.setblocking(False)  # the acceptor never waits on one peer
                _refuse(conn, RelayRequestError(
                    f"The relay for {self.store.location.url} refused a connection: it serves at most "
                    f"{self._max_connections} at once, more than this operation's processes open.",
                    file=self.store.location.url,
                ))
                conn.close()
                continue
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._idle)
            hello, size = _receive_header(conn, limit=_MAX_HELLO_BYTES)
            if size or not secrets.compare_digest(str(hello.get("secret")).encode(), self.secret.encode()):
                logger.warning("tpu_ckpt: dropped a relay connection without the operation's secret")
                return
            _send(conn, {"ok": True, "idle": self._idle})
            while self._serve_one(conn):
                pass
        except Exception as e:  # noqa: BLE001 - one bad connection must not take the server down
            if not self._closed:
                logger.warning("tpu_ckpt: relay connection ended abnormally: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                del self._handlers[conn]
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Waits for one request and answers it; False when the connection is to end.

        Between requests a client may be busy for long (snapshotting, placing arrays), up to
        the idle timeout: a connection silent for longer is closed, so a vanished peer holds
        no thread. Clients reconnect well before (see ``RelayStore._checkout``)."""
        conn.settimeout(self._idle)
        try:
            request, size = _receive_header(conn)
        except EOFError:
            return False  # the client is done
        except TimeoutError:
            logger.info("tpu_ckpt: closed a relay connection idle for %gs", self._idle)
            return False
        except ValueError as e:  # the stream cannot be followed any further
            refusal = self._refusal(f"an unreadable request ({e})", None)
            logger.warning("tpu_ckpt: %s", refusal)
            _refuse(conn, refusal)
            return False
        conn.settimeout(self._timeout)
        try:
            name = self._check(request, size)
        except RelayRequestError as refusal:
            logger.warning("tpu_ckpt: %s", refusal)
            _send(conn, {"error": error_to_json(refusal)})
            return request.get("op") == "write" or not size  # else unread bytes follow: drop
        self._answer(conn, request, name, size)
        return True

    def _check(self, request: dict[str, Any], size: int) -> str:
        """The file ``request`` names, once it is one this operation lets peers reach, with
        every length in bounds; else a :class:`RelayRequestError`, before storage is touched.

        Written names must be plain (one file in this directory). Read names need only be
        registered: the operation took them from a manifest it reads itself, and a linked
        checkpoint's data files lie in another directory (``../step_100/...``)."""
        op, name = request.get("op"), request.get("name")
        if not isinstance(name, str):
            raise self._refusal(f"a {op!r} request without a file name", None)
        if op == "write":
            if not (_PLAIN_NAME.fullmatch(name) and ".." not in name and self._accepts(name)):
                raise self._refusal(f"a write of {name!r}, which this operation does not accept", name)
            if size > MAX_FILE_BYTES:
                raise self._refusal(f"a write of {size} bytes to {name!r}; at most {MAX_FILE_BYTES} go through the relay", name)
            return name
        if size:
            raise self._refusal(f"a {op!r} request for {name!r} followed by {size} bytes", name)
        if op in ("read", "read_file") and name in self._serves:
            if op == "read":
                self._check_range(name, request.get("start"), request.get("lengths"))
            return name
        if op in ("read", "read_file"):
            raise self._refusal(f"a read of {name!r}, which this operation does not serve", name)
        if op == "piece" and self._shared is not None:
            if not (_is_count(request.get("offset")) and _is_count(request.get("process"))):
                raise self._refusal(f"a malformed piece request for {name!r}", name)
            return name
        raise self._refusal(f"an unknown request {op!r}", name)

    def _check_range(self, name: str, start: Any, lengths: Any) -> None:
        if not (
            _is_count(start) and isinstance(lengths, list) and len(lengths) <= MAX_RANGES
            and all(_is_count(n) for n in lengths)
        ):
            raise self._refusal(f"a malformed read of {name!r} (start and at most {MAX_RANGES} byte counts)", name)
        size, stop = self._serves[name], start + sum(lengths)
        if size is None:
            raise self._refusal(f"a ranged read of {name!r}, which is served whole only", name)
        if stop > size:
            raise self._refusal(f"bytes {start}..{stop} of {name!r}, which has {size}", name)

    def _refusal(self, what: str, name: str | None) -> RelayRequestError:
        where = self.store.location.url if name is None else self.store.location.child(name[:300])
        return RelayRequestError(
            f"The relay for {self.store.location.url} refused {what[:600]}. Only this operation's "
            "processes should connect to it: check for another job using the same hosts and ports.",
            file=where,
        )

    def _answer(self, conn: socket.socket, request: dict[str, Any], name: str, size: int) -> None:
        """Answers one allowed request. Storage errors go back to the client; socket errors
        end the connection (raised to :meth:`_serve`)."""
        op, where = request["op"], self.store.location.child(name)
        if op == "write":
            self._await_write_slot(conn)
            try:
                chunks = _receive_chunked(conn, size)
                answer = _outcome(lambda: self._write(name, chunks), where)
            finally:
                self._write_slots.release()
        elif op == "read":
            answer = _outcome(lambda: ({}, self.store.read(name, request["start"], request["lengths"]).result()), where)
        elif op == "read_file":
            answer = _outcome(lambda: self._read_file(name), where)
        else:
            answer = _outcome(lambda: ({}, self._shared(name, request["offset"], request["process"]).result()), where)
        _send(conn, *answer)

    def _await_write_slot(self, conn: socket.socket) -> None:
        """Holds a write back until fewer than ``MAX_WRITES_IN_FLIGHT`` files are in memory,
        telling the client every few seconds that it is queued: its timeout measures silence,
        and the queue can take longer than that when one host writes for a whole job."""
        while not self._write_slots.acquire(timeout=self._heartbeat):
            _send(conn, {"wait": True})
        try:
            _send(conn, {"go": True})
        except BaseException:
            self._write_slots.release()
            raise

    def _write(self, name: str, chunks: list[np.ndarray]) -> tuple[dict[str, Any], list[Any]]:
        self.store.write(name, chunks).result()
        return {}, []

    def _read_file(self, name: str) -> tuple[dict[str, Any], list[Any]]:
        data = self.store.read_file(name)
        return {"missing": data is None}, [data or b""]


def _is_count(value: Any) -> bool:
    """A byte offset or count within the relay's bounds (JSON gives any int, or none)."""
    return type(value) is int and 0 <= value <= MAX_FILE_BYTES


def _outcome(serve: Callable[[], tuple[dict[str, Any], list[Any]]], where: str) -> tuple[dict[str, Any], list[Any]]:
    """The answer to send: ``ok`` (plus what ``serve`` adds) and the payload, or the error
    raised while serving, naming ``where`` when the error itself does not."""
    try:
        extra, payload = serve()
    except Exception as e:  # noqa: BLE001 - delivered to the client, which raises it
        if not isinstance(e, errors.CheckpointError):
            e = errors.CheckpointError(f"{where}: {type(e).__name__}: {e}", file=where)
        return {"error": error_to_json(e)}, []
    return {"ok": True, **extra}, payload


class RelayStore:
    """Stands in for ``storage.Store`` on every process but the IO process."""

    def __init__(
        self, loc: storage.Location, contact: str, timeout: float, server_process: int,
        connections: int = CONNECTIONS_PER_CLIENT,
    ):
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
        except RelayConnectionError:
            self._close_connections()
            raise
        self._pool = storage.IOPool(connections)

    def __enter__(self) -> RelayStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()
        self._close_connections()

    def _close_connections(self) -> None:
        for conn in self._opened:
            conn.close()

    def _connect(self) -> socket.socket:
        """A new connection, past the server's handshake."""
        address, secret = self._contact.split(" ")
        host, port = address.rsplit(":", 1)
        try:
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=self._timeout)
            self._opened.append(conn)
            _send(conn, {"secret": secret})
            answer = _receive(conn)[0]
            if not answer.get("ok"):
                refusal = answer.get("error")
                raise EOFError(refusal.get("message") if isinstance(refusal, dict) else "the handshake was refused")
            idle = answer.get("idle")
            self._idle = float(idle) if isinstance(idle, (int, float)) and idle > 0 else math.inf
            return conn
        except (OSError, EOFError, ValueError) as e:
            raise RelayConnectionError(
                f"Could not connect to process {self.server_process} at {address} for {self.location.url}: {e}. "
                "Check that process's log.",
                file=self.location.url,
            ) from e

    def _checkout(self) -> socket.socket:
        """A free connection; one idle for half the server's idle timeout is replaced first,
        before the server closes it under a request."""
        conn, last_used = self._connections.get()
        if time.monotonic() - last_used < self._idle / 2:
            return conn
        conn.close()
        try:
            return self._connect()
        except RelayConnectionError:
            self._connections.put((conn, -math.inf))  # the next call tries again
            raise

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        views = [memoryview(b).cast("B") for b in buffers]
        return self._pool.submit(self._call, {"op": "write", "name": name}, views, None)

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        """Like ``storage.Store.read``: the server reads, this process checks (``then``)."""
        return self._receive_chunks({"op": "read", "name": name, "start": start, "lengths": list(lengths)}, lengths, then)

    def shared_piece(
        self, name: str, offset: int, length: int, requester: int, then: Callable[[list[np.ndarray]], Any]
    ) -> concurrent.futures.Future:
        """One piece the server's process reads for everyone (load_and_broadcast)."""
        request = {"op": "piece", "name": name, "offset": offset, "process": requester}
        return self._receive_chunks(request, [length], then)

    def _receive_chunks(
        self, request: dict[str, Any], lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None
    ) -> concurrent.futures.Future:
        def call_and_then() -> list[np.ndarray]:
            chunks = [storage.aligned_empty(n) for n in lengths]
            self._call(request, [], chunks)
            if then is not None:
                then(chunks)
            return chunks

        return self._pool.submit(call_and_then)

    def read_file(self, name: str) -> bytes | None:
        answer, data = self._call({"op": "read_file", "name": name}, [], None)
        return None if answer.get("missing") else data

    def _call(
        self, request: dict[str, Any], payload: Sequence[memoryview], into: list[np.ndarray] | None
    ) -> tuple[dict[str, Any], bytes]:
        """One request and its answer on a free connection. The answer's payload goes into
        ``into`` when given (no copy), else it is returned as bytes. A write's payload follows
        the server's go-ahead (see ``RelayServer._await_write_slot``); a refused write gets
        an error instead, and sends nothing.

        A connection that failed mid-message is closed before it goes back to the pool: its
        stream is out of step, and a later request must fail, not read an old answer."""
        conn = self._checkout()
        try:
            if request["op"] == "write":
                _send_header(conn, request, sum(len(v) for v in payload))
                go = _receive(conn)[0]
                while go.get("wait"):
                    go = _receive(conn)[0]
                if "error" in go:
                    raise error_from_json(go["error"])
                _send_payload(conn, payload)
            else:
                _send(conn, request)
            answer, size = _receive_header(conn)
            if "error" in answer:
                _discard(conn, size)
                raise error_from_json(answer["error"])
            if into is not None:
                if size != sum(a.nbytes for a in into):
                    raise EOFError(f"the answer has {size} bytes, not the {sum(a.nbytes for a in into)} asked for")
                _receive_into(conn, into)
                return answer, b""
            if size > MAX_FILE_BYTES:
                raise ValueError(f"the answer claims {size} bytes, more than the relay's {MAX_FILE_BYTES}")
            return answer, b"".join(_receive_chunked(conn, size))
        except errors.CheckpointError:
            raise  # the server's answer: the stream is in step
        except (OSError, EOFError, ValueError) as e:
            conn.close()
            raise RelayConnectionError(
                f"Lost the connection to process {self.server_process} during {request['op']} "
                f"{request.get('name', '')} of {self.location.url}: {e}. Check that process's log.",
                file=self.location.child(request.get("name", "")),
            ) from e
        finally:
            self._connections.put((conn, time.monotonic()))


def _send(conn: socket.socket, message: dict[str, Any], payload: Sequence[Any] = ()) -> None:
    views = [memoryview(p).cast("B") for p in payload]
    _send_header(conn, message, sum(len(v) for v in views))
    _send_payload(conn, views)


def _send_header(conn: socket.socket, message: dict[str, Any], payload_size: int) -> None:
    meta = json.dumps(message).encode()
    conn.sendall(_HEADER.pack(len(meta), payload_size) + meta)


def _send_payload(conn: socket.socket, views: Sequence[memoryview]) -> None:
    for view in views:
        for start in range(0, len(view), _CHUNK):
            conn.sendall(view[start : start + _CHUNK])


def _refuse(conn: socket.socket, error: RelayRequestError) -> None:
    """Tells a peer why it is being dropped, if it can take the message at once."""
    try:
        _send(conn, {"error": error_to_json(error)})
    except OSError:
        pass


def _receive_header(conn: socket.socket, limit: int = MAX_MESSAGE_BYTES) -> tuple[dict[str, Any], int]:
    """A message's JSON object and the length of the payload that follows (which the caller
    bounds before reading it). A malformed or oversized message is a ValueError."""
    head = bytearray(_HEADER.size)
    _receive_into(conn, [head])
    meta_size, payload_size = _HEADER.unpack(head)
    if meta_size > limit:
        raise ValueError(f"a {meta_size}-byte message where at most {limit} may come")
    meta = bytearray(meta_size)
    _receive_into(conn, [meta])
    try:
        message = json.loads(meta)
    except RecursionError:
        raise ValueError("a message nested too deeply") from None
    if not isinstance(message, dict):
        raise ValueError("a message that is not a JSON object")
    return message, payload_size


def _receive(conn: socket.socket) -> tuple[dict[str, Any], bytes]:
    """A small message (handshake, queue notices): its payload is bounded like its JSON."""
    message, size = _receive_header(conn)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a {size}-byte payload where at most {MAX_MESSAGE_BYTES} may come")
    data = bytearray(size)
    _receive_into(conn, [data])
    return message, bytes(data)


def _receive_into(conn: socket.socket, buffers: Sequence[Any]) -> None:
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while len(view):
            n = conn.recv_into(view[:_CHUNK])
            if n == 0:
                raise EOFError("the peer closed the connection")
            view = view[n:]


def _receive_chunked(conn: socket.socket, size: int) -> list[np.ndarray]:
    """``size`` payload bytes, in buffers allocated only as bytes arrive: a peer that claims
    much and sends little costs little memory."""
    chunks = []
    while size:
        chunks.append(storage.aligned_empty(min(size, _CHUNK)))
        _receive_into(conn, chunks[-1:])
        size -= chunks[-1].nbytes
    return chunks


def _discard(conn: socket.socket, size: int) -> None:
    scratch = bytearray(min(size, _CHUNK))
    while size:
        _receive_into(conn, [memoryview(scratch)[: min(size, _CHUNK)]])
        size -= min(size, _CHUNK)


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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
    return cls(str(data.get("message")), key=key if isinstance(key, str) else None, file=file if isinstance(file, str) else None)
