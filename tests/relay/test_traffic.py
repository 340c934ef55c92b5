"""The relay's own count of what it moved (``traffic()``, #37 item 6): connections opened
and accepted, bytes sent and received, with a real server and client over loopback TCP."""

import numpy as np

from tpu_ckpt import relay, storage
from tpu_ckpt.relay._wire import traffic


def test_connections_and_bytes_are_counted_at_both_ends(tmp_path):
    store = storage.open_staging(storage.Location(str(tmp_path / "ckpt")))
    server = relay.RelayServer(
        store, "127.0.0.1", timeout=10, peers=1, serves={"d.bin": 1 << 20}, accepts={"d.bin"}.__contains__
    )
    before = traffic()
    client = relay.RelayStore(storage.Location("ckpt"), server.contact(), timeout=10, server_process=0, connections=2)
    try:
        data = np.arange(1 << 20, dtype=np.uint8)
        client.write("d.bin", [data]).result()
        assert client.read("d.bin", 0, [1 << 20]).result()[0].tobytes() == data.tobytes()
    finally:
        client.close()
        server.close()
        store.close()
    moved = {field: traffic()[field] - before[field] for field in before}
    # one process is both ends here: each connection counted once opened and once accepted
    assert moved["opened"] == 2 and moved["accepted"] == 2, moved
    # the file went out and came back: each byte sent once and received once, each way; plus headers
    assert 2 << 20 < moved["sent"] == moved["received"] < (2 << 20) + 4096, moved
