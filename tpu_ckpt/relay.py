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
connection without the secret is dropped. Every socket operation is bounded by
``coordination_timeout``, so a dead peer is an error, never a hang.

Wire format: each message is a 16-byte header (two big-endian uint64: JSON length, payload
length), a JSON object, then the payload bytes.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpu_ckpt import errors, storage

logger = logging.getLogger(__name__)

CONNECTIONS_PER_CLIENT = 4
MAX_WRITES_IN_FLIGHT = 4  # files the server holds in memory at once, across all clients
HEARTBEAT_SECONDS = 5.0  # while a write waits for a slot, the server says so this often
_MAX_HELLO_BYTES = 1 << 16  # what an unauthenticated peer may make the server read
_HEADER = struct.Struct("!QQ")
_CHUNK = 8 << 20  # one bounded socket call: the timeout measures progress, not the whole file


class RelayConnectionError(errors.CheckpointError):
    """The relay connection failed (refused, reset, timed out): the other process may have
    failed first, which its own report explains better."""


class RelayServer:
    """Serves one storage location (a checkpoint or its staging area) to the other processes.

    Errors raised while serving go back to the caller, which re-raises them as the same
    ``CheckpointError`` subclass.
    """

    def __init__(
        self, store: storage.Store, host: str, timeout: float,
        shared: Callable[[str, int, int], concurrent.futures.Future] | None = None,
        *, write_slots: int = MAX_WRITES_IN_FLIGHT, heartbeat: float = HEARTBEAT_SECONDS,
    ):
        self.store = store
        self.secret = secrets.token_hex(16)
        self._timeout = timeout
        self._shared = shared  # load_and_broadcast: (file, offset, requester) -> the piece's bytes
        self._write_slots = threading.BoundedSemaphore(write_slots)
        self._heartbeat = heartbeat
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self.address = f"[{host}]:{self._listener.getsockname()[1]}" if ":" in host else f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._handlers: list[threading.Thread] = []
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
            connections = list(self._connections)
        _shutdown(self._listener)  # wakes the blocked accept(); close() alone does not
        self._listener.close()
        for conn in connections:
            _shutdown(conn)
        self._acceptor.join()
        for handler in self._handlers:
            handler.join()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.append(conn)
                handler = threading.Thread(target=self._serve, args=(conn,), name="tpu_ckpt relay", daemon=True)
                self._handlers.append(handler)
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self._timeout)
        try:
            hello, size = _receive_header(conn, limit=_MAX_HELLO_BYTES)
            if size or not isinstance(hello, dict) or not secrets.compare_digest(
                str(hello.get("secret")).encode(), self.secret.encode()
            ):
                logger.warning("tpu_ckpt: dropped a relay connection without the operation's secret")
                return
            _send(conn, {"ok": True})
            while True:
                # Between requests a client may be busy for long (snapshotting, placing arrays):
                # no timeout there; close() ends the wait when the operation is over.
                conn.settimeout(None)
                try:
                    request, size = _receive_header(conn)
                except EOFError:
                    return  # the client is done
                conn.settimeout(self._timeout)
                self._answer(conn, request, size)
        except Exception as e:  # noqa: BLE001 - one bad connection must not take the server down
            if not self._closed:
                logger.warning("tpu_ckpt: relay connection ended abnormally: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)
            conn.close()

    def _answer(self, conn: socket.socket, request: dict[str, Any], size: int) -> None:
        """Answers one request. Storage errors go back to the client; socket errors end the
        connection (raised to :meth:`_serve`)."""
        op, name = request.get("op"), request.get("name", "")
        where = self.store.location.child(name)
        if op == "write":
            self._await_write_slot(conn)
            try:
                data = storage.aligned_empty(size)
                _receive_into(conn, [data])
                answer = _outcome(lambda: self._write(name, data), where)
            finally:
                self._write_slots.release()
        elif op == "read":
            answer = _outcome(lambda: ({}, self.store.read(name, request["start"], request["lengths"]).result()), where)
        elif op == "read_file":
            answer = _outcome(lambda: self._read_file(name), where)
        elif op == "piece" and self._shared is not None:
            answer = _outcome(lambda: ({}, self._shared(name, request["offset"], request["process"]).result()), where)
        else:
            answer = {"error": error_to_json(errors.CheckpointError(f"internal: unknown relay request {op!r}"))}, []
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

    def _write(self, name: str, data: np.ndarray) -> tuple[dict[str, Any], list[Any]]:
        self.store.write(name, [data]).result()
        return {}, []

    def _read_file(self, name: str) -> tuple[dict[str, Any], list[Any]]:
        data = self.store.read_file(name)
        return {"missing": data is None}, [data or b""]


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
        address, secret = contact.split(" ")
        host, port = address.rsplit(":", 1)
        self._connections: queue.SimpleQueue = queue.SimpleQueue()
        opened: list[socket.socket] = []
        try:
            for _ in range(connections):
                opened.append(socket.create_connection((host.strip("[]"), int(port)), timeout=timeout))
                _send(opened[-1], {"secret": secret})
                if not _receive(opened[-1])[0].get("ok"):
                    raise EOFError("the handshake was refused")
        except (OSError, EOFError, ValueError) as e:
            for conn in opened:
                conn.close()
            raise RelayConnectionError(
                f"Could not connect to process {server_process} at {address} for {loc.url}: {e}. "
                "Check that process's log.",
                file=loc.url,
            ) from e
        for conn in opened:
            self._connections.put(conn)
        self._opened = opened  # closed at close() even if a caller still has one checked out
        self._pool = storage.IOPool(connections)

    def __enter__(self) -> RelayStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()
        for conn in self._opened:
            conn.close()

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
        return None if answer["missing"] else data

    def _call(
        self, request: dict[str, Any], payload: Sequence[memoryview], into: list[np.ndarray] | None
    ) -> tuple[dict[str, Any], bytes]:
        """One request and its answer on a free connection. The answer's payload goes into
        ``into`` when given (no copy), else it is returned as bytes. A write's payload follows
        the server's go-ahead (see ``RelayServer._await_write_slot``).

        A connection that failed mid-message is closed before it goes back to the pool: its
        stream is out of step, and a later request must fail, not read an old answer."""
        conn = self._connections.get()
        try:
            if request["op"] == "write":
                _send_header(conn, request, sum(len(v) for v in payload))
                while _receive(conn)[0].get("wait"):
                    pass
                _send_payload(conn, payload)
            else:
                _send(conn, request)
            answer, size = _receive_header(conn)
            if "error" in answer:
                _discard(conn, size)
                raise error_from_json(answer["error"])
            if into is not None and size != sum(a.nbytes for a in into):
                raise EOFError(f"the answer has {size} bytes, not the {sum(a.nbytes for a in into)} asked for")
            data = into if into is not None else [storage.aligned_empty(size)]
            _receive_into(conn, data)
            return answer, b"" if into is not None else data[0].tobytes()
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
            self._connections.put(conn)


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


def _receive_header(conn: socket.socket, limit: int | None = None) -> tuple[dict[str, Any], int]:
    head = bytearray(_HEADER.size)
    _receive_into(conn, [head])
    meta_size, payload_size = _HEADER.unpack(head)
    if limit is not None and meta_size + payload_size > limit:
        raise ValueError(f"a {meta_size + payload_size}-byte message where at most {limit} may come")
    meta = bytearray(meta_size)
    _receive_into(conn, [meta])
    return json.loads(meta), payload_size


def _receive(conn: socket.socket) -> tuple[dict[str, Any], bytes]:
    message, size = _receive_header(conn)
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


def _discard(conn: socket.socket, size: int) -> None:
    if size:
        _receive_into(conn, [bytearray(size)])


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def error_to_json(error: BaseException) -> dict[str, Any]:
    if isinstance(error, errors.CheckpointError):
        return {"type": type(error).__name__, "message": str(error), "key": error.key, "file": error.file}
    return {"type": "CheckpointError", "message": f"{type(error).__name__}: {error}", "key": None, "file": None}


def error_from_json(data: dict[str, Any]) -> errors.CheckpointError:
    """The same error type the IO process raised (a plain CheckpointError for the others)."""
    cls = getattr(errors, data["type"], errors.CheckpointError)
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)) or cls in (
        errors.CoordinationTimeoutError,
    ):
        cls = errors.CheckpointError
    return cls(data["message"], key=data["key"], file=data["file"])
