"""Storage locations and the commit protocol."""

import os

import pytest

from tpu_ckpt import storage


def test_locations_map_to_kvstore_specs(monkeypatch, tmp_path):
    assert storage.location(tmp_path / "c").kvstore_spec() == {"driver": "file", "path": str(tmp_path / "c") + "/"}
    assert storage.location("memory://a/b").kvstore_spec() == {"driver": "memory", "path": "a/b/"}
    assert storage.location("gs://bucket/run/step_1").kvstore_spec() == {"driver": "gcs", "bucket": "bucket", "path": "run/step_1/"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert storage.location("s3://b/p").kvstore_spec() == {"driver": "s3", "bucket": "b", "path": "p/", "endpoint": "http://127.0.0.1:9000"}
    with pytest.raises(ValueError, match="Unsupported checkpoint location 'ftp://x'"):
        storage.location("ftp://x")
    with pytest.raises(ValueError, match="empty"):
        storage.location("")


def test_local_staging_is_a_sibling_and_commit_renames(tmp_path):
    final = storage.location(tmp_path / "c")
    staging = final.staging("abc")
    assert staging.local_path == str(tmp_path / "c") + ".tmp-abc"
    store = storage.Store(staging)
    store.write("x", b"123").result()
    assert store.read_file("x") == b"123" and store.read("x", 1, 2).result().value == b"2"
    assert store.list() == ["x"] and store.exists("x") and not store.exists("y")
    assert not storage.is_empty(staging) and storage.is_empty(final)
    storage.commit(staging, final)
    assert os.listdir(tmp_path) == ["c"] and (tmp_path / "c" / "x").read_bytes() == b"123"


def test_object_stores_write_in_place_and_remove_clears_the_prefix():
    final = storage.location("memory://storage_test/c")
    assert final.staging("abc") == final
    store = storage.Store(final)
    store.write("a", b"1").result()
    store.write("b/c", b"2").result()
    storage.commit(final, final)  # nothing to rename
    assert store.list() == ["a", "b/c"]
    storage.remove(final)
    assert storage.is_empty(final)
