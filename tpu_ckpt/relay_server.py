"""The relay's server: the process that opens storage serves it to the others (``relay.py``).

Even a peer holding the operation's secret reaches only what its operation needs, and cannot
exhaust the server: a server serves only the files its operation registered (a restore: the
manifest and the data files it lists) and accepts only the names the operation's other
processes write (a save: their data files and index); every length on the wire is bounded
before anything is allocated (``relay_wire``'s limits, a ranged read inside its file's
registered size), and a write's bytes are allocated as they arrive. At most ``(peers + 1)
* relay_connections`` connections (a setting) are served at once, and one silent for the
idle timeout is closed; a client reconnects before using a connection idle for half of it. A refused request gets a :class:`~tpu_ckpt.relay_wire.RelayRequestError` naming the file.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import re
import secrets
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tpu_ckpt import errors, relay_wire, storage
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

_MAX_HELLO_BYTES = 1 << 16  # what an unauthenticated peer may make the server read
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # one file in the checkpoint's directory
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
        self, store: storage.CheckpointStore, host: str, timeout: float, *, peers: int,
        serves: Mapping[str, int | None] | None = None,
        accepts: Callable[[str], bool] = lambda name: False,
        shared: Callable[[str, int, int], concurrent.futures.Future] | None = None,
        idle_timeout: float | None = None,
        write_slots: int | None = None, heartbeat: float | None = None,
    ):
        self.store = store
        self.secret = secrets.token_hex(16)
        self._timeout = timeout
        self._idle = timeout if idle_timeout is None else idle_timeout
        self._serves = dict(serves or {})
        self._accepts = accepts
        self._shared = shared  # load_and_broadcast: (file, offset, requester) -> the piece's bytes
        knobs = settings()
        self._max_connections = (peers + 1) * knobs.relay_connections  # room for one stray or reconnecting peer
        self._write_slots = threading.BoundedSemaphore(knobs.relay_writes_in_flight if write_slots is None else write_slots)
        self._heartbeat = knobs.relay_heartbeat_seconds if heartbeat is None else heartbeat
        self._buffer_bytes = knobs.relay_socket_buffer_bytes
        self._listener = _listen(host, self._max_connections, self._buffer_bytes, store.location.url)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
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
                _refuse(conn, relay_wire.RelayRequestError(
                    f"The relay for {self.store.location.url} refused a connection: it serves at most "
                    f"{self._max_connections} at once, more than this operation's processes open.",
                    file=self.store.location.url,
                ))
                conn.close()
                continue
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            relay_wire.tune(conn, self._buffer_bytes)  # before the handshake's answer: set once a client is in
            conn.settimeout(self._idle)
            hello, size = relay_wire.receive_header(conn, limit=_MAX_HELLO_BYTES)
            if size or not secrets.compare_digest(str(hello.get("secret")).encode(), self.secret.encode()):
                logger.warning("tpu_ckpt: dropped a relay connection without the operation's secret")
                return
            relay_wire.send(conn, {"ok": True, "idle": self._idle})
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
            request, size = relay_wire.receive_header(conn)
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
        every length in bounds; else a :class:`~tpu_ckpt.relay_wire.RelayRequestError`,
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
            raise self._refusal(f"a write of {size} bytes to {name!r}; at most {relay_wire.MAX_FILE_BYTES} go through the relay", name)

    def _check_read(self, op: str, name: str, request: dict[str, Any]) -> None:
        """Read names need only be registered: the operation took them from a manifest it
        reads itself, and a linked checkpoint's data files lie in another directory
        (``../step_100/...``)."""
        if name not in self._serves:
            raise self._refusal(f"a read of {name!r}, which this operation does not serve", name)
        if op == "read":
            self._check_range(name, request.get("start"), request.get("lengths"))

    def _check_range(self, name: str, start: Any, lengths: Any) -> None:
        if not (
            _is_count(start) and isinstance(lengths, list) and len(lengths) <= relay_wire.MAX_RANGES
            and all(_is_count(n) for n in lengths)
        ):
            raise self._refusal(f"a malformed read of {name!r} (start and at most {relay_wire.MAX_RANGES} byte counts)", name)
        size, stop = self._serves[name], start + sum(lengths)
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
            answer = _outcome(lambda: ({}, self.store.read(name, request["start"], request["lengths"]).result()), where)
        elif op == "read_file":
            answer = _outcome(lambda: self._read_file(name), where)
        else:
            answer = _outcome(lambda: ({}, self._shared(name, request["offset"], request["process"]).result()), where)
        relay_wire.send(conn, *answer)

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
        self.store.write(name, chunks).result()
        return {}, []

    def _read_file(self, name: str) -> tuple[dict[str, Any], list[Any]]:
        data = self.store.read_file(name)
        return {"missing": data is None}, [data or b""]


def _listen(host: str, backlog: int, buffer_bytes: int, where: str) -> socket.socket:
    """A socket listening on the first free port of ``Settings.relay_ports`` (any port when
    unset). The backlog holds every connection the server serves: SYNs a whole pod sends at
    once must not overflow it, or clients would wait on retransmissions."""
    ports = settings().relay_ports
    first, last = ports or (0, 0)
    for port in range(first, last + 1):
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
            relay_wire.tune(listener, buffer_bytes)
            listener.bind((host, port))
            listener.listen(backlog)
            return listener
        except OSError as e:
            listener.close()
            if e.errno != errno.EADDRINUSE or ports is None:
                raise relay_wire.RelayBindError(
                    f"The relay for {where} cannot listen on {host}:{port}: {e}. If {host} is not an address "
                    "of this host, set TPU_CKPT_RELAY_HOST to one the job's other hosts reach it at.",
                    file=where,
                ) from e
    raise relay_wire.RelayBindError(
        f"The relay for {where} cannot listen on {host}: every port of TPU_CKPT_RELAY_PORTS={first}-{last} is "
        "in use. Widen the range (each save or restore through the relay holds a port on every serving "
        "process while it runs) and allow the wider range through the firewall between the job's hosts.",
        file=where,
    )


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
