"""The relay's server: the process that opens storage serves it to the others (``relay/_client.py``).

Even a peer holding the operation's secret reaches only what its operation needs, and cannot exhaust the server: a
server serves only the files its operation registered (a restore: the manifest and the data files it lists) and accepts
only the names the operation's other processes write (a save: their data files and index); every length on the wire is
bounded before anything is allocated (``relay_wire``'s limits; a read names one span of its file, inside the file's
registered size, never a list of pieces to keep track of), and a write's bytes are allocated as they arrive. At most
``(peers + 1) * relay_connections`` authenticated connections (a setting) are served at once, and one silent for the
idle timeout is closed; a client reconnects before using a connection idle for half of it.

A connection that has not yet sent the secret does not count against that cap: it must complete its hello within a short
deadline (a whole, which a peer trickling a byte at a time cannot stretch), and at most ``_MAX_HANDSHAKES`` wait for
theirs, the oldest dropped for a newcomer, so strays, scanners or a flood keep no process of the job out. A refused
request gets a :class:`~tpu_ckpt.relay._wire.RelayRequestError` naming the file.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tpu_ckpt import errors, storage
from tpu_ckpt.relay import _wire as relay_wire
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

_HANDSHAKE_SECONDS = 10.0  # for a hello the client sends as soon as it is connected
_MAX_HANDSHAKES = 128  # connections waiting for their hello; beyond, the oldest is dropped
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # one file in the checkpoint's directory


class RelayServer:
    """Serves one storage location (a checkpoint or its staging area) to the other processes.

    ``serves`` maps the files peers may read to their size (None: read whole only), and ``accepts`` says which plain
    file names they may write; ``shared`` answers load_and_broadcast's piece requests, checking them against its plan.
    ``peers`` is the number of processes that connect, which bounds the connections served at once;
    ``handshake_timeout`` how long a new connection has to send the secret.

    Errors raised while serving go back to the caller, which re-raises them as the same ``CheckpointError`` subclass.
    """

    def __init__(
        self, store: storage.ReadableStore, host: str, timeout: float, *, peers: int,
        serves: Mapping[str, int | None] | None = None,
        accepts: Callable[[str], bool] = lambda name: False,
        shared: Callable[[str, int, int], concurrent.futures.Future] | None = None,
        idle_timeout: float | None = None, handshake_timeout: float | None = None,
        write_slots: int | None = None, heartbeat: float | None = None,
    ):
        self.store = store
        self.secret = secrets.token_hex(16)
        self._timeout = timeout
        self._idle = timeout if idle_timeout is None else idle_timeout
        self._handshake = min(_HANDSHAKE_SECONDS, self._idle) if handshake_timeout is None else handshake_timeout
        self._serves = dict(serves or {})
        self._accepts = accepts
        self._shared = shared  # load_and_broadcast: (file, offset, requester) -> the piece's bytes
        knobs = settings()
        self._max_connections = (peers + 1) * knobs.relay_connections  # room for one stray or reconnecting peer
        slots = knobs.relay_writes_in_flight if write_slots is None else write_slots
        self._write_slots = threading.BoundedSemaphore(slots)
        self._heartbeat = knobs.relay_heartbeat_seconds if heartbeat is None else heartbeat
        self._buffer_bytes = knobs.relay_socket_buffer_bytes
        self._listener = relay_wire.listen(host, self._max_connections + _MAX_HANDSHAKES, self._buffer_bytes,
                                           store.location.url)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._lock = threading.Lock()
        self._handlers: dict[socket.socket, threading.Thread] = {}  # open connections only
        self._pending: dict[socket.socket, None] = {}  # those awaiting their hello, oldest first
        self._authenticated: set[socket.socket] = set()  # those past it: the ones the cap counts
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
                full = len(self._authenticated) >= self._max_connections
                if not full:
                    self._make_room(peer)
                    deadline = time.monotonic() + self._handshake
                    handler = threading.Thread(target=self._serve, args=(conn, deadline), name="tpu_ckpt relay",
                                               daemon=True)
                    self._handlers[conn] = handler
                    self._pending[conn] = None
            if full:
                logger.warning("tpu_ckpt: refused a relay connection from %s: %d already open",
                               peer, self._max_connections)
                conn.setblocking(False)  # the acceptor never waits on one peer
                _refuse(conn, self._full())
                conn.close()
                continue
            handler.start()

    def _make_room(self, peer: Any) -> None:
        """Drops the connection that has waited longest for its hello when ``_MAX_HANDSHAKES``
        wait: a client of the job says hello at once, so the newcomer is the likelier one.
        Its handler, woken, ends it. Called holding the lock."""
        if len(self._pending) < _MAX_HANDSHAKES:
            return
        oldest = next(iter(self._pending))
        del self._pending[oldest]
        logger.warning("tpu_ckpt: dropped the oldest of %d relay connections awaiting their hello, for one from %s",
                       _MAX_HANDSHAKES, peer)
        _shutdown(oldest)

    def _full(self) -> relay_wire.RelayRequestError:
        return relay_wire.RelayRequestError(
            f"The relay for {self.store.location.url} refused a connection: it serves at most "
            f"{self._max_connections} at once, more than this operation's processes open.",
            file=self.store.location.url,
        )

    def _serve(self, conn: socket.socket, deadline: float) -> None:
        try:
            relay_wire.tune(conn, self._buffer_bytes)  # before the handshake's answer: set once a client is in
            if not self._admit(conn, deadline):
                return
            while self._serve_one(conn):
                pass
        except Exception as e:  # noqa: BLE001 - one bad connection must not take the server down
            if not self._closed:
                logger.warning("tpu_ckpt: relay connection ended abnormally: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                del self._handlers[conn]
                self._pending.pop(conn, None)
                self._authenticated.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket, deadline: float) -> bool:
        """Whether ``conn`` sent the secret by ``deadline`` and an authenticated connection
        was free for it; it is told so (or why not)."""
        try:
            hello, size = relay_wire.receive_header(conn, limit=relay_wire.MAX_REQUEST_BYTES, deadline=deadline)
        except EOFError:  # a port scanner, or a connection dropped for a newer one (_make_room)
            logger.info("tpu_ckpt: a relay connection closed before its hello")
            return False
        except (OSError, ValueError) as e:  # TimeoutError is an OSError
            logger.warning("tpu_ckpt: dropped a relay connection without a readable hello within %gs: %s",
                           self._handshake, e)
            return False
        if size or not secrets.compare_digest(str(hello.get("secret")).encode(), self.secret.encode()):
            logger.warning("tpu_ckpt: dropped a relay connection without the operation's secret")
            return False
        with self._lock:
            self._pending.pop(conn, None)
            full = len(self._authenticated) >= self._max_connections
            if not full:
                self._authenticated.add(conn)
        conn.settimeout(self._timeout)
        if full:
            _refuse(conn, self._full())
            return False
        relay_wire.admitted(conn, self._idle)
        return True

    def _serve_one(self, conn: socket.socket) -> bool:
        """Waits for one request and answers it; False when the connection is to end.

        Between requests a client may be busy for long (snapshotting, placing arrays), up to
        the idle timeout: a connection silent for longer is closed, so a vanished peer holds
        no thread. Clients reconnect well before (see ``RelayStore._checkout``)."""
        conn.settimeout(self._idle)
        try:
            request, size = relay_wire.receive_header(conn, limit=relay_wire.MAX_REQUEST_BYTES)
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
        except relay_wire.RelayRequestError as refusal:
            logger.warning("tpu_ckpt: %s", refusal)
            relay_wire.send(conn, {"error": relay_wire.error_to_json(refusal)})
            return request.get("op") == "write" or not size  # else unread bytes follow: drop
        self._answer(conn, request, name, size)
        return True

    def _check(self, request: dict[str, Any], size: int) -> str:
        """The file ``request`` names, once it is one this operation lets peers reach, with
        every length in bounds; else a :class:`~tpu_ckpt.relay._wire.RelayRequestError`,
        before storage is touched. Only a write is followed by bytes."""
        op, name = request.get("op"), request.get("name")
        if not isinstance(name, str):
            raise self._refusal(f"a {op!r} request without a file name", None)
        if op == "write":
            self._check_write(name, size)
        elif size:
            raise self._refusal(f"a {op!r} request for {name!r} followed by {size} bytes", name)
        elif op in ("read", "read_file"):
            self._check_read(op, name, request)
        elif op == "piece" and self._shared is not None:
            if not (_is_count(request.get("offset")) and _is_count(request.get("process"))):
                raise self._refusal(f"a malformed piece request for {name!r}", name)
        else:
            raise self._refusal(f"an unknown request {op!r}", name)
        return name

    def _check_write(self, name: str, size: int) -> None:
        """Written names must be plain: one file in this directory."""
        if not (_PLAIN_NAME.fullmatch(name) and ".." not in name and self._accepts(name)):
            raise self._refusal(f"a write of {name!r}, which this operation does not accept", name)
        if size > relay_wire.MAX_FILE_BYTES:
            raise self._refusal(
                f"a write of {size} bytes to {name!r}; at most {relay_wire.MAX_FILE_BYTES} go through the relay", name
            )

    def _check_read(self, op: str, name: str, request: dict[str, Any]) -> None:
        """Read names need only be registered: the operation took them from a manifest it reads itself, and a linked
        checkpoint's data files lie in another directory (``../step_100/...``)."""
        if name not in self._serves:
            raise self._refusal(f"a read of {name!r}, which this operation does not serve", name)
        if op == "read":
            self._check_range(name, request.get("start"), request.get("length"))

    def _check_range(self, name: str, start: Any, length: Any) -> None:
        if not (_is_count(start) and _is_count(length)):
            raise self._refusal(f"a malformed read of {name!r} (a start and a length, byte counts)", name)
        size, stop = self._serves[name], start + length
        if size is None:
            raise self._refusal(f"a ranged read of {name!r}, which is served whole only", name)
        if stop > size:
            raise self._refusal(f"bytes {start}..{stop} of {name!r}, which has {size}", name)

    def _refusal(self, what: str, name: str | None) -> relay_wire.RelayRequestError:
        where = self.store.location.url if name is None else self.store.location.child(name[:300])
        return relay_wire.RelayRequestError(
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
                chunks = relay_wire.receive_chunked(conn, size)
                answer = _outcome(lambda: self._write(name, chunks), where)
            finally:
                self._write_slots.release()
        elif op == "read":
            answer = _outcome(lambda: ({}, self.store.read(name, request["start"], [request["length"]]).result()),
                              where)
        elif op == "read_file":
            answer = _outcome(lambda: self._read_file(name), where)
        else:
            answer = _outcome(lambda: self._piece(name, request["offset"], request["process"]), where)
        relay_wire.send(conn, *answer)

    def _piece(self, name: str, offset: int, process: int) -> tuple[dict[str, Any], list[Any]]:
        if self._shared is None:  # ``_check`` lets a piece request through only with ``shared``
            raise self._refusal(f"a piece of {name!r}, which this operation does not serve", name)
        return {}, self._shared(name, offset, process).result()

    def _await_write_slot(self, conn: socket.socket) -> None:
        """Holds a write back until fewer than ``relay_writes_in_flight`` files are in memory,
        telling the client every few seconds that it is queued: its timeout measures silence,
        and the queue can take longer than that when one host writes for a whole job."""
        while not self._write_slots.acquire(timeout=self._heartbeat):
            relay_wire.send(conn, {"wait": True})
        try:
            relay_wire.send(conn, {"go": True})
        except BaseException:
            self._write_slots.release()
            raise

    def _write(self, name: str, chunks: list[np.ndarray]) -> tuple[dict[str, Any], list[Any]]:
        _writable(self.store).write(name, chunks).result()
        return {}, []

    def _read_file(self, name: str) -> tuple[dict[str, Any], list[Any]]:
        data = self.store.read_file(name)
        return {"missing": data is None}, [data or b""]


def _writable(store: storage.ReadableStore) -> storage.CheckpointStore:
    """The store a relay that ``accepts`` writes puts them in: one that takes writes."""
    if not isinstance(store, storage.CheckpointStore):
        raise TypeError(f"the relay for {store.location.url} accepted a write, and serves it read-only")
    return store


def _is_count(value: Any) -> bool:
    """A byte offset or count within the relay's bounds (JSON gives any int, or none)."""
    return type(value) is int and 0 <= value <= relay_wire.MAX_FILE_BYTES


def _outcome(serve: Callable[[], tuple[dict[str, Any], list[Any]]], where: str) -> tuple[dict[str, Any], list[Any]]:
    """The answer to send: ``ok`` (plus what ``serve`` adds) and the payload, or the error
    raised while serving, naming ``where`` when the error itself does not."""
    try:
        extra, payload = serve()
    except Exception as e:  # noqa: BLE001 - delivered to the client, which raises it
        if not isinstance(e, errors.CheckpointError):
            e = errors.CheckpointError(f"{where}: {type(e).__name__}: {e}", file=where)
        return {"error": relay_wire.error_to_json(e)}, []
    return {"ok": True, **extra}, payload


def _refuse(conn: socket.socket, error: relay_wire.RelayRequestError) -> None:
    """Tells a peer why it is being dropped, if it can take the message at once."""
    try:
        relay_wire.send(conn, {"error": relay_wire.error_to_json(error)})
    except OSError:
        pass


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
