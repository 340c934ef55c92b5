"""Symbolic links in a checkpoint: every byte read comes from a regular file inside the
checkpoint (or a linked checkpoint's source), whatever a link points at (issue #26)."""

import os
import shutil

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import files, manifest
from tpu_ckpt import storage
from tpu_ckpt.catalog import verify

TREE = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7, np.int32)}


@pytest.fixture
def ckpt(tmp_path):
    tc.save(tmp_path / "c", TREE)
    return tmp_path / "c"


def _linked_out(ckpt, name: str) -> str:
    """Replaces ``name`` by a link to an exact copy outside the checkpoint: its crc32c still
    matches, so only where the bytes come from tells it apart."""
    outside = ckpt.parent / f"outside-{os.path.basename(name)}"
    shutil.copyfile(ckpt / name, outside)
    os.unlink(ckpt / name)
    os.symlink(outside, ckpt / name)
    return str(ckpt / name)


def _kinds(ckpt) -> dict[str, str]:
    doc = manifest(ckpt)
    return {"manifest": "manifest.json", "data file": next(iter(files(ckpt))), "piece table": doc["tables"][0][0]}


@pytest.mark.parametrize("kind", ["manifest", "data file", "piece table"])
def test_a_file_linked_outside_the_checkpoint_is_not_read(ckpt, kind):
    name = _kinds(ckpt)[kind]
    path = _linked_out(ckpt, name)
    with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint") as e:
        tc.restore(ckpt)
    assert e.value.file == path
    report = verify(ckpt)
    assert not report.ok and report.problems[0].where == path


def test_a_directory_linked_outside_is_not_followed(ckpt, tmp_path):
    """A directory on the way out is refused like a link to the file itself."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "elsewhere", ckpt / "sub")
    with storage.Store(storage.location(ckpt)) as store:
        with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
            store.read("sub/secret", 0, [6]).result()
        with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
            store.read_file("sub/secret")


def test_a_link_to_a_device_is_refused_without_opening_it(ckpt):
    name = next(iter(files(ckpt)))
    os.unlink(ckpt / name)
    os.symlink("/dev/urandom", ckpt / name)
    with pytest.raises(tc.CorruptCheckpointError, match="character device outside checkpoint"):
        tc.restore(ckpt)


def test_a_link_inside_the_checkpoint_and_a_linked_checkpoint_still_read(ckpt, tmp_path):
    """A link to one of the checkpoint's own files stays inside it; so does a linked
    checkpoint's ``../<source>/<file>``, even when reached through a linked root."""
    name = next(iter(files(ckpt)))
    os.rename(ckpt / name, ckpt / "moved")
    os.symlink("moved", ckpt / name)
    assert np.array_equal(tc.restore(ckpt)["w"], TREE["w"])
    tc.export_for_serving(ckpt, tmp_path / "served", subtree="", link=True)
    os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}-alias")
    served = tmp_path.parent / f"{tmp_path.name}-alias" / "served"
    assert np.array_equal(tc.restore(served)["w"], TREE["w"])
    assert verify(served).ok


def test_open_confined_is_the_one_confined_open(ckpt):
    fd = storage.open_confined(str(ckpt), "manifest.json")
    try:
        assert os.read(fd, 1) == b"{"
    finally:
        os.close(fd)
    _linked_out(ckpt, "manifest.json")
    with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
        storage.open_confined(str(ckpt), "manifest.json")
