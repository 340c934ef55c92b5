"""The io_device relay in one process: a real server and client over loopback TCP."""

import errno
import logging
import socket
import time

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import relay, storage
from tpu_ckpt.format import ALIGNMENT
from tpu_ckpt.relay import _wire as relay_wire
from tpu_ckpt.settings import settings

SERVES = {"d.bin": 1 << 20, "short.bin": 10, "nope.safetensors": 4, "absent.json": None}
ACCEPTS = {"d.bin", "short.bin", "still.bin", "taken", "after", "x.bin"}.__contains__


@pytest.fixture
def served(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, serves=SERVES, accepts=ACCEPTS)
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0)
    yield tmp_path / "ckpt", client, server.address
    client.close()
    server.close()
    store.close()


def test_writes_and_reads_go_through_the_server(served):
    root, client, _ = served
    data = np.arange(1 << 20, dtype=np.uint8)
    client.write("d.bin", [data[:1000], data[1000:]]).result()
    assert (root / "d.bin").read_bytes() == data.tobytes()
    chunks = client.read("d.bin", 10, [5, 1 << 16]).result()
    assert [c.tobytes() for c in chunks] == [data[10:15].tobytes(), data[15 : 15 + (1 << 16)].tobytes()]
    assert all(c.ctypes.data % ALIGNMENT == 0 for c in chunks)  # zero-copy device_put still applies
    assert client.read_file("d.bin") == data.tobytes()
    assert client.read_file("absent.json") is None


def test_server_errors_arrive_as_the_same_typed_error(served):
    _, client, _ = served
    with pytest.raises(tc.CorruptCheckpointError, match="missing") as e:
        client.read("nope.safetensors", 0, [4]).result()
    assert e.value.file.endswith("nope.safetensors")
    client.write("short.bin", [b"abc"]).result()
    with pytest.raises(tc.CorruptCheckpointError, match="truncated"):
        client.read("short.bin", 0, [10]).result()


def test_a_connection_without_the_secret_is_dropped(served):
    root, client, address = served
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        relay_wire.send(conn, {"secret": "guess"})
        with pytest.raises(EOFError):
            relay_wire.receive(conn)
    client.write("still.bin", [b"ok"]).result()  # the real client is unaffected
    assert (root / "still.bin").read_bytes() == b"ok"


def test_a_closed_server_is_a_checkpoint_error_not_a_hang(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=5, peers=1, accepts=ACCEPTS)
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=5, server_process=3)
    server.close()
    with pytest.raises(tc.CheckpointError, match="Lost the connection to process 3"):
        client.write("x.bin", [b"x"]).result()
    client.close()
    store.close()


def test_a_connection_that_failed_mid_answer_is_never_reused(tmp_path):
    """A request that timed out leaves its answer in flight; the next request on that
    connection must fail, not read the old answer as its own."""
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    store.write("f", [b"ffff"]).result()

    def slow_piece(name, offset, requester):
        time.sleep(1.0)
        return store.read(name, offset, [4])

    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, serves={"f": 4}, shared=slow_piece)
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=0.3, server_process=1, connections=1)
    with pytest.raises(relay_wire.RelayConnectionError, match="Lost the connection to process 1"):
        client.shared_piece("f", 0, 4, requester=0, then=lambda chunks: None).result()
    time.sleep(1.0)  # the late answer has arrived by now
    with pytest.raises(relay_wire.RelayConnectionError):
        client.read("f", 0, [4]).result()
    client.close()
    server.close()
    store.close()


def test_a_queued_write_outlasts_the_timeout_while_the_server_says_it_is_queued(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(
        store, "127.0.0.1", timeout=10, peers=1, accepts={"first", "second"}.__contains__, write_slots=1, heartbeat=0.1
    )
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as hog:  # holds the only slot for 1.5 s
        relay_wire.send(hog, {"secret": server.secret})
        assert relay_wire.receive(hog)[0]["ok"]
        relay_wire.send_header(hog, {"op": "write", "name": "first"}, 3)
        assert relay_wire.receive(hog)[0] == {"go": True}
        client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=0.5, server_process=0)
        queued = client.write("second", [b"222"])
        time.sleep(1.5)  # three timeouts' worth of waiting, heartbeats all along
        assert not queued.done()
        relay_wire.send_payload(hog, [memoryview(b"111")])
        assert relay_wire.receive(hog)[0] == {"ok": True}
    queued.result(timeout=5)
    assert (tmp_path / "ckpt" / "first").read_bytes() == b"111"
    assert (tmp_path / "ckpt" / "second").read_bytes() == b"222"
    client.close()
    server.close()
    store.close()


def test_a_storage_error_on_the_server_names_the_file(served):
    root, client, _ = served
    (root / "taken").mkdir(parents=True)
    with pytest.raises(tc.CheckpointError, match="Is a directory") as e:
        client.write("taken", [b"x"]).result()
    assert e.value.file.endswith("taken")
    client.write("after", [b"ok"]).result()  # the connection is still in step
    assert (root / "after").read_bytes() == b"ok"


@pytest.fixture
def server(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, serves=SERVES, accepts=ACCEPTS)
    yield server
    server.close()
    store.close()


def _connect(server, hello=True):
    host, port = server.address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    if hello:
        relay_wire.send(conn, {"secret": server.secret})
        assert relay_wire.receive(conn)[0]["ok"]
    return conn


def _refusal(conn):
    answer = relay_wire.receive(conn)[0]
    assert answer["error"]["type"] == "RelayRequestError", answer
    return answer["error"]["message"]


def _eventually(condition):
    """Waits for what the server does on its own threads (the deadline only stops a hang)."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "ABSOLUTE", "d.bin/../../x", "other.bin"])
def test_a_peer_reads_only_the_files_its_operation_serves(served, tmp_path, name):
    root, client, _ = served
    (tmp_path / "x").write_bytes(b"outside")
    name = str(tmp_path / "x") if name == "ABSOLUTE" else name
    with pytest.raises(relay_wire.RelayRequestError, match="does not serve") as e:
        client.read_file(name)
    assert e.value.file.endswith(name)
    with pytest.raises(relay_wire.RelayRequestError, match="does not serve"):
        client.read(name, 0, [7]).result()
    client.write("d.bin", [b"abc"]).result()  # the connections are still in step
    assert client.read("d.bin", 0, [3]).result()[0].tobytes() == b"abc"


@pytest.mark.parametrize("name", ["../y", "ABSOLUTE", "sub/../../y", "", ".", "manifest.json", "index-00000.json"])
def test_a_peer_writes_only_plain_names_its_operation_accepts(tmp_path, name):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    anything = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, accepts=lambda n: "json" not in n)
    client = relay.RelayStore(storage.Location("ckpt"), anything.contact(), timeout=10, server_process=0, connections=1)
    name = str(tmp_path / "y") if name == "ABSOLUTE" else name
    with pytest.raises(relay_wire.RelayRequestError, match="does not accept") as e:
        client.write(name, [b"evil"]).result()
    assert e.value.file.endswith(name)
    assert [p.name for p in tmp_path.rglob("*")] == ["ckpt"]  # nothing was written anywhere
    client.write("fine.bin", [b"ok"]).result()  # refused before its bytes were sent: still in step
    assert (tmp_path / "ckpt" / "fine.bin").read_bytes() == b"ok"
    client.close()
    anything.close()
    store.close()


def test_a_huge_message_length_is_refused_and_the_connection_dropped(server):
    with _connect(server) as conn:
        conn.sendall(relay_wire._HEADER.pack(2**60, 0))
        assert f"{2**60}-byte message" in _refusal(conn)
        assert conn.recv(1) == b""
    with _connect(server) as conn:  # a read request followed by bytes it should not have
        relay_wire.send_header(conn, {"op": "read_file", "name": "absent.json"}, 2**60)
        assert "followed by" in _refusal(conn)
        assert conn.recv(1) == b""
    with _connect(server) as conn:  # the server is still serving
        relay_wire.send(conn, {"op": "read_file", "name": "absent.json"})
        assert relay_wire.receive(conn)[0] == {"ok": True, "missing": True}


@pytest.mark.parametrize("request_", [
    {"op": "write", "name": "d.bin", "size": 2**60},
    {"op": "read", "name": "d.bin", "start": 0, "length": 2**60},
    {"op": "read", "name": "d.bin", "start": 2**60, "length": 1},
    {"op": "read", "name": "d.bin", "start": 0, "length": (1 << 20) + 1},  # past the file's size
    {"op": "read", "name": "d.bin", "start": 0, "lengths": [1]},  # the span only: pieces are the client's
    {"op": "read", "name": "d.bin", "start": -1, "length": 1},
    {"op": "read", "name": "d.bin", "start": 0, "length": "1"},
    {"op": "read", "name": "absent.json", "start": 0, "length": 1},  # served whole only
    {"op": "piece", "name": "d.bin", "offset": 0, "process": 0},  # no load_and_broadcast here
    {"op": "delete", "name": "d.bin"},
])
def test_a_request_beyond_the_bounds_is_refused_before_any_allocation(server, request_):
    with _connect(server) as conn:
        request = dict(request_)
        relay_wire.send_header(conn, request, request.pop("size", 0))
        _refusal(conn)
        relay_wire.send(conn, {"op": "read_file", "name": "absent.json"})  # still in step
        assert relay_wire.receive(conn)[0] == {"ok": True, "missing": True}


def test_connections_beyond_the_cap_are_refused_until_one_ends(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=0)  # room for one client's connections
    conns = [_connect(server) for _ in range(settings().relay_connections)]
    with _connect(server, hello=False) as extra:
        assert f"at most {settings().relay_connections}" in _refusal(extra)
        assert extra.recv(1) == b""
    conns.pop().close()
    _eventually(lambda: len(server._handlers) < settings().relay_connections)
    conns.append(_connect(server))  # room again
    for conn in conns:
        conn.close()
    _eventually(lambda: not server._handlers)
    server.close()
    store.close()


def test_an_idle_connection_is_closed_and_its_handler_ends(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, idle_timeout=0.2)
    with _connect(server) as idle, _connect(server, hello=False) as silent:
        assert idle.recv(1) == b""  # the server closed it (our own timeout would raise)
        assert silent.recv(1) == b""  # one that never said hello, too
    _eventually(lambda: not server._handlers)
    server.close()
    store.close()


def test_a_client_replaces_a_connection_before_the_server_closes_it_idle(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, accepts=ACCEPTS, idle_timeout=0.4)
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0, connections=1)
    client.write("x.bin", [b"1"]).result()
    time.sleep(1.0)  # idle past the server's timeout: it has closed the connection
    client.write("x.bin", [b"2"]).result()
    assert (tmp_path / "ckpt" / "x.bin").read_bytes() == b"2"
    assert len(client._opened) == 2  # on a new connection
    client.close()
    server.close()
    store.close()


def test_every_relay_socket_has_nodelay_and_the_buffers_asked_for(tmp_path, knobs):
    knobs(relay_socket_buffer_bytes=128 << 10)  # below any kernel's cap
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, accepts=ACCEPTS)
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0, connections=2)
    client.write("x.bin", [b"1"]).result()
    sockets = client._opened + list(server._handlers)
    assert len(sockets) == 4  # both ends of both connections
    for conn in sockets:
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 128 << 10
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 128 << 10
    client.close()
    server.close()
    store.close()


def test_buffers_the_kernel_caps_are_reported(tmp_path, knobs, caplog):
    knobs(relay_socket_buffer_bytes=1 << 30)  # beyond net.core.rmem_max anywhere
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    with caplog.at_level(logging.INFO, logger="tpu_ckpt.relay._wire"):
        server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1)
    assert "of the 1073741824 asked" in caplog.text and "net.core.rmem_max" in caplog.text
    server.close()
    store.close()


def _hold(first):
    """Two adjacent ports from ``first`` on, listened on here (outside Linux's ephemeral range,
    so no other socket takes them by chance)."""
    for port in range(first, 65535):
        held = []
        try:
            for p in (port, port + 1):
                held.append(socket.create_server(("127.0.0.1", p)))
            return port, held
        except OSError as e:
            assert e.errno == errno.EADDRINUSE
            for conn in held:
                conn.close()
    raise AssertionError("no two adjacent free ports")


def test_the_server_listens_on_the_first_free_port_of_the_range(tmp_path, knobs):
    taken, held = _hold(61000)
    knobs(relay_ports=(taken, taken + 50))
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, accepts=ACCEPTS)
    port = int(server.contact().split(" ")[0].rsplit(":", 1)[1])
    assert taken + 2 <= port <= taken + 50
    with relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0) as client:
        client.write("x.bin", [b"1"]).result()
    server.close()
    store.close()
    for conn in held:
        conn.close()


def test_a_range_without_a_free_port_is_a_typed_error_naming_it(tmp_path, knobs):
    taken, held = _hold(62000)
    knobs(relay_ports=(taken, taken + 1))
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    with pytest.raises(relay_wire.RelayBindError, match=f"TPU_CKPT_RELAY_PORTS={taken}-{taken + 1} is in use"):
        relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1)
    store.close()
    for conn in held:
        conn.close()


def _unreachable(contact):
    """What a client gets from ``contact``, long before a coordination_timeout of 300 s."""
    with pytest.raises(relay_wire.RelayUnreachableError) as e:
        relay.RelayStore(storage.Location("ckpt"), contact + " secret", timeout=300, server_process=2)
    message = str(e.value)
    assert f"process 2's relay at {contact}" in message
    assert "firewall" in message and "TPU_CKPT_RELAY_HOST" in message
    return message


@pytest.mark.timeout(60)
def test_a_port_nothing_listens_on_is_a_prompt_typed_error_naming_it():
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        message = _unreachable(f"127.0.0.1:{bound.getsockname()[1]}")
    assert "refused" in message and "any TCP port" in message


@pytest.mark.timeout(60)
def test_a_host_that_drops_connections_is_a_typed_error_after_the_connect_timeout(knobs):
    """A full accept queue drops SYNs, as a firewall does: only the connect timeout ends the wait."""
    knobs(relay_connect_seconds=0.5, relay_ports=(50100, 50199))
    with socket.create_server(("127.0.0.1", 0), backlog=0) as deaf:
        queued = []
        while True:  # until the accept queue, never drained, is full
            conn = socket.socket()
            queued.append(conn)
            conn.settimeout(0.5)
            try:
                conn.connect(deaf.getsockname())
            except TimeoutError:
                break
        message = _unreachable(f"127.0.0.1:{deaf.getsockname()[1]}")
        for conn in queued:
            conn.close()
    assert "within 0.5s: timed out" in message and "TCP ports 50100-50199 (TPU_CKPT_RELAY_PORTS)" in message


def test_a_read_claiming_a_terabyte_is_refused_before_the_client_allocates_it(tmp_path):
    """Issue 29: an io_device restore whose manifest gives a piece 2^40 bytes. The server,
    which has the file, refuses the read from its real size; the client allocates its arrays
    only for an answer, so it never asks for the terabyte (ENOMEM before, or worse)."""
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    (tmp_path / "ckpt" / "d.safetensors").write_bytes(b"x" * 64)
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, peers=1, serves={"d.safetensors": 1 << 41})
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0)
    try:
        with pytest.raises(tc.CorruptCheckpointError, match="truncated") as e:
            client.read("d.safetensors", 0, [1 << 40]).result()
        assert e.value.file.endswith("d.safetensors")
        assert [c.tobytes() for c in client.read("d.safetensors", 8, [8]).result()] == [b"x" * 8]
    finally:
        client.close()
        server.close()
        store.close()
