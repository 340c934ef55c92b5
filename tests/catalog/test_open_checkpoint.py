"""One open checkpoint: a restore, metadata, verify and diff each open a checkpoint's store
once, and every read (manifest, piece-table rows, data) goes through it."""

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import CountingStore
from tpu_ckpt import catalog, restoring, storage
from tpu_ckpt.catalog import diff, verify


@pytest.fixture
def saved(tmp_path, mesh42):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    tree = {"w": jax.device_put(w, NamedSharding(mesh42, P("data", "model"))), "b": np.arange(4, dtype=np.int32),
            "step": 3}
    tc.save(tmp_path / "a", tree)
    tc.save(tmp_path / "b", {**tree, "b": np.arange(4, dtype=np.int32) + 1})
    return tmp_path


@pytest.fixture
def opened(monkeypatch):
    """The locations of the stores opened (storage.Store, as every reader calls it)."""
    real, urls = storage.Store, []

    def counted(loc, **kw):
        urls.append(loc.url)
        return real(loc, **kw)

    monkeypatch.setattr(storage, "Store", counted)
    return urls


def test_each_reader_opens_the_checkpoint_once(saved, opened):
    a, b = saved / "a", saved / "b"
    np.testing.assert_array_equal(np.asarray(tc.restore(a)["w"]), np.arange(64).reshape(8, 8))
    assert opened == [storage.location(a).url]
    opened.clear()
    assert tc.metadata(a)["w"].shape == (8, 8) and len(opened) == 1
    opened.clear()
    assert verify(a).ok and opened == [storage.location(a).url]
    opened.clear()
    assert [c.key for c in diff(a, b, values=True)] == ["b"] and len(opened) == 2


def test_every_read_goes_through_the_one_store(saved):
    loc = storage.location(saved / "a")
    with CountingStore(storage.Store(loc)) as store, catalog.open_checkpoint(store) as checkpoint:
        tree, count, _ = restoring.restore_from(checkpoint, None, tc.CheckpointOptions(), None, None)
    assert count == 3 and tree["step"] == 3
    assert store.files.count("manifest.json") == 1
    assert any(name.startswith("pieces-") for name in store.files)  # the table rows, through it too
    data = {name for name in store.files if name.endswith(".safetensors")}
    assert data == set(checkpoint.manifest.files)


def test_opening_names_what_is_missing(tmp_path, saved):
    with pytest.raises(tc.CheckpointNotFoundError, match="directory of checkpoints"):
        catalog.open_checkpoint(saved)
    with pytest.raises(tc.CheckpointNotFoundError):
        catalog.open_checkpoint(tmp_path / "nothing")
    (saved / "a" / "manifest.json").unlink()
    with CountingStore(storage.Store(storage.location(saved / "a"))) as relayed:  # a store that cannot list: a relay's
        with pytest.raises(tc.UncommittedCheckpointError, match="manifest.json") as e:
            catalog.open_checkpoint(relayed)
    assert e.value.file == storage.location(saved / "a").url
