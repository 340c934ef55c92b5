"""The io_device relay in one process: a real server and client over loopback TCP."""

import socket
import time

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import relay, storage


@pytest.fixture
def served(tmp_path):
    store = storage.Store(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10)
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
    assert all(c.ctypes.data % storage.ALIGNMENT == 0 for c in chunks)  # zero-copy device_put still applies
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
        relay._send(conn, {"secret": "guess"})
        with pytest.raises(EOFError):
            relay._receive(conn)
    client.write("still.bin", [b"ok"]).result()  # the real client is unaffected
    assert (root / "still.bin").read_bytes() == b"ok"


def test_a_closed_server_is_a_checkpoint_error_not_a_hang(tmp_path):
    store = storage.Store(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=5)
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=5, server_process=3)
    server.close()
    with pytest.raises(tc.CheckpointError, match="Lost the connection to process 3"):
        client.write("x.bin", [b"x"]).result()
    client.close()
    store.close()


def test_a_connection_that_failed_mid_answer_is_never_reused(tmp_path):
    """A request that timed out leaves its answer in flight; the next request on that
    connection must fail, not read the old answer as its own."""
    store = storage.Store(storage.Location(str(tmp_path / "ckpt")))
    store.write("f", [b"ffff"]).result()

    def slow_piece(name, offset, requester):
        time.sleep(1.0)
        return store.read(name, offset, [4])

    server = relay.RelayServer(store, "127.0.0.1", timeout=10, shared=slow_piece)
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=0.3, server_process=1, connections=1)
    with pytest.raises(relay.RelayConnectionError, match="Lost the connection to process 1"):
        client.shared_piece("f", 0, 4, requester=0, then=lambda chunks: None).result()
    time.sleep(1.0)  # the late answer has arrived by now
    with pytest.raises(relay.RelayConnectionError):
        client.read("f", 0, [4]).result()
    client.close()
    server.close()
    store.close()


def test_a_queued_write_outlasts_the_timeout_while_the_server_says_it_is_queued(tmp_path):
    store = storage.Store(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(store, "127.0.0.1", timeout=10, write_slots=1, heartbeat=0.1)
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as hog:  # holds the only slot for 1.5 s
        relay._send(hog, {"secret": server.secret})
        assert relay._receive(hog)[0] == {"ok": True}
        relay._send_header(hog, {"op": "write", "name": "first"}, 3)
        assert relay._receive(hog)[0] == {"go": True}
        client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=0.5, server_process=0)
        queued = client.write("second", [b"222"])
        time.sleep(1.5)  # three timeouts' worth of waiting, heartbeats all along
        assert not queued.done()
        relay._send_payload(hog, [memoryview(b"111")])
        assert relay._receive(hog)[0] == {"ok": True}
    queued.result(timeout=5)
    assert (tmp_path / "ckpt" / "first").read_bytes() == b"111"
    assert (tmp_path / "ckpt" / "second").read_bytes() == b"222"
    client.close()
    server.close()
    store.close()


def test_a_storage_error_on_the_server_names_the_file(served):
    root, client, _ = served
    (root / "taken").mkdir(parents=True)
    with pytest.raises(tc.CheckpointError, match="IsADirectoryError") as e:
        client.write("taken", [b"x"]).result()
    assert e.value.file.endswith("taken")
    client.write("after", [b"ok"]).result()  # the connection is still in step
    assert (root / "after").read_bytes() == b"ok"
