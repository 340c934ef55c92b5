"""Issue #29: what strays on the network, an authenticated peer, or links planted in a
checkpoint cannot make a relay server, or an export, do. Real servers and clients over
loopback TCP, as in test_relay.py; real checkpoints on disk."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import relay, storage
from tpu_ckpt.relay import _server as relay_server
from tpu_ckpt.relay import _wire as relay_wire
from tpu_ckpt.settings import settings

SERVES = {"d.bin": 1 << 20}
ACCEPTS = {"d.bin"}.__contains__


def _open(server):
    host, port = server.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _eventually(condition):
    """Waits for what the server does on its own threads (the deadline only stops a hang)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


class Tricklers:
    """Connections that never say hello: each announces a 60000-byte hello, then sends it a
    byte at a time, every 50 ms, so that no per-call socket timeout ever fires."""

    def __init__(self, server, count):
        self.conns = []
        for _ in range(count):
            conn = _open(server)
            conn.sendall(relay_wire._HEADER.pack(60000, 0))
            self.conns.append(conn)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self):
        while not self._stop.wait(0.05):
            for conn in self.conns:
                try:
                    conn.send(b" ")
                except OSError:  # dropped by the server
                    pass

    def close(self):
        self._stop.set()
        self._thread.join()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def store(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    yield store
    store.close()


@pytest.mark.parametrize("count", [64, 200])  # 200: more than may await their hello at once
def test_a_client_is_served_while_unauthenticated_connections_trickle(store, tmp_path, count):
    """Before: the tricklers took every one of the (1 + 1) * 4 connections, whose idle
    timeout each byte restarts, and the job's own client was refused."""
    server = relay_server.RelayServer(
        store, "127.0.0.1", timeout=10, peers=1, serves=SERVES, accepts=ACCEPTS, idle_timeout=3, handshake_timeout=120,
    )
    tricklers = Tricklers(server, count)
    waiting = min(count, relay_server._MAX_HANDSHAKES)
    _eventually(lambda: len(server._pending) == waiting == len(server._handlers))
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0)
    data = np.arange(1 << 20, dtype=np.uint8)
    client.write("d.bin", [data]).result()
    assert client.read("d.bin", 7, [9, 100]).result()[1].tobytes() == data[16:116].tobytes()
    still = len(server._pending)  # the tricklers still connected, waiting
    assert still >= waiting - settings().relay_connections and still >= 64
    assert (tmp_path / "ckpt" / "d.bin").read_bytes() == data.tobytes()
    client.close()
    tricklers.close()
    server.close()


def test_a_trickled_hello_is_dropped_at_the_handshake_deadline(store):
    """Before: the idle timeout (60 s here) bounded each byte, never the hello as a whole."""
    server = relay_server.RelayServer(store, "127.0.0.1", timeout=10, peers=1, idle_timeout=60, handshake_timeout=0.5)
    tricklers = Tricklers(server, 1)
    _eventually(lambda: not server._handlers)  # its handler ended, though bytes kept coming
    try:
        closed = tricklers.conns[0].recv(1) == b""
    except ConnectionResetError:  # closed with our bytes unread
        closed = True
    assert closed
    tricklers.close()
    with relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0, connections=1):
        pass  # the server still serves
    server.close()


def test_millions_of_zero_length_ranges_are_refused_before_they_are_read(store):
    """Before: a read listing 2M zero-length ranges (6 MB of JSON, under the 16 MiB limit)
    was read, parsed and served, each range an array and a view: +619 MB. A read names its
    span now, and a request is refused by its header's length, before the server reads it."""
    server = relay_server.RelayServer(store, "127.0.0.1", timeout=10, peers=1, serves=SERVES, accepts=ACCEPTS)
    request = json.dumps({"op": "read", "name": "d.bin", "start": 0, "lengths": [0] * 2_000_000}).encode()
    with _open(server) as conn:
        relay_wire.send(conn, {"secret": server.secret})
        assert relay_wire.receive(conn)[0]["ok"]
        conn.sendall(relay_wire._HEADER.pack(len(request), 0))
        answer = relay_wire.receive(conn)[0]
        assert answer["error"]["type"] == "RelayRequestError"
        said = f"a {len(request)}-byte message where at most {relay_wire.MAX_REQUEST_BYTES} may come"
        assert said in answer["error"]["message"]
        assert conn.recv(1) == b""  # the rest of that stream cannot be followed: dropped
    with relay.RelayStore(
        storage.Location("ckpt"), server.contact(), timeout=10, server_process=0, connections=1
    ) as client:
        client.write("d.bin", [b"abcdef"]).result()
        chunks = client.read("d.bin", 1, [0] * 100_000 + [3, 0, 2]).result()  # pieces are the client's bookkeeping
        assert len(chunks) == 100_003 and chunks[-3].tobytes() == b"bcd" and chunks[-1].tobytes() == b"ef"
    server.close()


@pytest.fixture
def planted(tmp_path):
    """A checkpoint directory whose data file and manifest are links out of it."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "outside.bin").write_bytes(b"root:x:0:0")
    os.symlink(tmp_path / "outside.bin", tmp_path / "ckpt" / "d.bin")
    os.symlink(tmp_path / "outside.bin", tmp_path / "ckpt" / "m.json")
    return tmp_path / "ckpt"


def test_the_relay_serves_no_bytes_through_a_link_out_of_the_checkpoint(planted):
    with storage.Store(storage.Location(str(planted)), threads=1) as store:
        server = relay_server.RelayServer(store, "127.0.0.1", timeout=10, peers=1, serves={"d.bin": 10, "m.json": None})
        with relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0) as client:
            with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint") as e:
                client.read("d.bin", 0, [10]).result()
            assert e.value.file.endswith("d.bin")
            with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint") as e:
                client.read_file("m.json")
            assert e.value.file.endswith("m.json")
        server.close()


@pytest.fixture
def linked_out(tmp_path):
    """A saved checkpoint whose data files were moved out of it, links left in their place:
    the bytes (and so their crc32c) are right, but they are not the checkpoint's."""
    params = {"w": np.arange(64, dtype=np.float32), "b": np.ones(4, np.float32)}
    tc.save(tmp_path / "train", {"params": params})
    (tmp_path / "elsewhere").mkdir()
    data = [name for name in os.listdir(tmp_path / "train") if name.endswith(".safetensors")]
    assert data
    for name in data:
        os.rename(tmp_path / "train" / name, tmp_path / "elsewhere" / name)
        os.symlink(tmp_path / "elsewhere" / name, tmp_path / "train" / name)
    return tmp_path / "train"


@pytest.mark.parametrize("link", [False, True])
def test_export_follows_no_link_out_of_the_checkpoint(linked_out, tmp_path, link):
    """Before: the copy took the outside bytes into the serving checkpoint, and the link
    pointed the serving checkpoint at them."""
    with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
        tc.export_for_serving(linked_out, tmp_path / "serve", link=link)
    assert not os.path.exists(tmp_path / "serve" / "manifest.json")


@pytest.mark.slow
def test_tpu_ckpt_export_names_the_link_in_one_line(linked_out, tmp_path):
    cli = os.path.join(os.path.dirname(sys.executable), "tpu-ckpt")
    result = subprocess.run(
        [cli, "export", linked_out, tmp_path / "serve"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert "outside checkpoint" in result.stderr and str(linked_out) in result.stderr
    assert not os.path.exists(tmp_path / "serve" / "manifest.json")
