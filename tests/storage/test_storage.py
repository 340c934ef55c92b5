"""Storage locations and the commit protocol."""

import os

import jax
import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import relay, storage
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import ALIGNMENT
from tpu_ckpt.settings import Settings, configure
from tpu_ckpt.storage._local import LocalStore


def test_locations_map_to_kvstore_specs(tmp_path):
    assert storage.location(tmp_path / "c").kvstore_spec() == {"driver": "file", "path": str(tmp_path / "c") + "/"}
    assert storage.location("memory://a/b").kvstore_spec() == {"driver": "memory", "path": "a/b/"}
    assert storage.location("gs://bucket/run/step_1").kvstore_spec() == {
        "driver": "gcs", "bucket": "bucket", "path": "run/step_1/"
    }
    previous = configure(Settings(aws_endpoint_url="http://127.0.0.1:9000"))
    try:
        assert storage.location("s3://b/p").kvstore_spec() == {"driver": "s3", "bucket": "b", "path": "p/", "endpoint": "http://127.0.0.1:9000"}
    finally:
        configure(previous)
    with pytest.raises(ValueError, match="Unsupported checkpoint location 'ftp://x'"):
        storage.location("ftp://x")
    with pytest.raises(ValueError, match="empty"):
        storage.location("")


def test_writev_handles_many_and_partial_buffers(tmp_path):
    buffers = [np.full(i % 7, i % 256, np.uint8) for i in range(3000)]  # more than IOV_MAX, some empty
    with storage.Store(storage.location(tmp_path)) as store:
        store.write("f", buffers).result()
    assert (tmp_path / "f").read_bytes() == b"".join(b.tobytes() for b in buffers)


def test_local_staging_is_a_sibling_and_commit_renames(tmp_path):
    final = storage.location(tmp_path / "c")
    staging = final.staging("abc")
    assert staging.local_path == str(tmp_path / "c") + ".tmp-abc"
    storage.open_staging(staging).close()  # creates the directory, as a save does
    with storage.Store(staging) as store:
        store.write("x", [b"12", np.frombuffer(b"3", np.uint8)]).result()
        assert store.read_file("x") == b"123"
        first, second = store.read("x", 0, [1, 2]).result()
        assert first.tobytes() == b"1" and second.tobytes() == b"23"
        assert all(a.ctypes.data % ALIGNMENT == 0 for a in (first, second))
        assert store.list() == ["x"] and store.read_file("y") is None
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            store.read("x", 1, [4]).result()
        with pytest.raises(CorruptCheckpointError, match="missing"):
            store.read("y", 0, [1]).result()
    assert not storage.is_empty(staging) and storage.is_empty(final)
    storage.publish(staging, final)
    assert os.listdir(tmp_path) == ["c"] and (tmp_path / "c" / "x").read_bytes() == b"123"


def test_object_stores_write_in_place_and_remove_clears_the_prefix():
    final = storage.location("memory://storage_test/c")
    assert final.staging("abc") == final
    with storage.Store(final) as store:
        store.write("a", [b"1"]).result()
        store.write("b/c", [b"2", b"3"]).result()
        storage.publish(final, final)  # nothing to rename
        assert store.list() == ["a", "b/c"] and store.read("b/c", 1, [1]).result()[0].tobytes() == b"3"
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            store.read("a", 0, [3]).result()
    storage.remove(final)
    assert storage.is_empty(final)


def test_an_object_store_prefix_lists_its_own_keys_only():
    with storage.Store(storage.location("memory://prefixes/step_1")) as store:
        store.write("a", [b"1"]).result()
    with storage.Store(storage.location("memory://prefixes/step_10")) as store:
        store.write("b", [b"2"]).result()
    storage.remove(storage.location("memory://prefixes/step_1"))
    with storage.Store(storage.location("memory://prefixes")) as store:
        assert store.list() == ["step_10/b"]


def test_each_location_opens_a_backend_of_the_storage_protocol(tmp_path):
    for url, backend in ((str(tmp_path), LocalStore), ("memory://protocol/c", storage.ObjectStore)):
        with storage.Store(storage.location(url)) as store:
            assert isinstance(store, backend) and isinstance(store, storage.Backend)
    assert storage.CheckpointStore in relay.RelayStore.__mro__  # declared: it stands in for a backend


def test_a_restore_hands_jax_fresh_aligned_memory_without_a_copy(tmp_path):
    """Never the file's pages (see safe_reads): a restored array must not follow its file."""
    tree = {"n": np.int32(5), "w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    tc.save(tmp_path / "c", tree)
    out = tc.restore(tmp_path / "c")
    assert out["w"].ctypes.data % ALIGNMENT == 0  # aligned, though a scalar precedes it
    assert str(tmp_path) not in _mapped_file(out["w"].ctypes.data)
    on_cpu = tc.restore(tmp_path / "c", {"n": 0, "w": jax.ShapeDtypeStruct((64, 64), np.float32)})
    np.testing.assert_array_equal(np.asarray(on_cpu["w"]), tree["w"])
    assert str(tmp_path) not in _mapped_file(on_cpu["w"].unsafe_buffer_pointer())


def _mapped_file(address: int) -> str:
    """What this process has mapped at ``address``: a file's path, "[heap]", or "" (anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else ""
    return ""
