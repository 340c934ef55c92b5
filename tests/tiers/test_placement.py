"""Where the local tier lives, checked at construction and at the first local save: the root
or an overlay file system is warned of, and so is a RAM disk smaller than the tier's formula,
(1 + replicas) x (local_max_to_keep + 1) x the host's share, plus the async snapshot."""

import logging
import os
import tempfile

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.tiers import _placement as placement

RAM = "/dev/shm"
needs_ram_disk = pytest.mark.skipif(placement.mount_of(RAM)[1] != "tmpfs", reason="no tmpfs at /dev/shm")


def test_a_local_directory_on_the_root_file_system_is_warned_of(tmp_path, caplog):
    if placement.mount_of(str(tmp_path))[0] != "/":
        pytest.skip("tmp_path is not on the root file system here")
    caplog.set_level(logging.WARNING)
    tc.CheckpointManager(str(tmp_path / "p"), local_directory=str(tmp_path / "local")).close()
    assert "is on the root file system" in caplog.text and "/dev/shm" in caplog.text


@needs_ram_disk
def test_a_local_directory_in_memory_is_not_warned_of(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    with tempfile.TemporaryDirectory(dir=RAM) as local:
        with tc.CheckpointManager(str(tmp_path / "p"), local_directory=local, local_replicas=0) as m:
            m.save(1, {"w": np.ones(4, np.float32)})
    assert "file system" not in caplog.text and "RAM disk" not in caplog.text


@needs_ram_disk
def test_a_ram_disk_smaller_than_the_tier_takes_is_warned_of_once(caplog):
    caplog.set_level(logging.WARNING)
    size = os.statvfs(RAM).f_blocks * os.statvfs(RAM).f_frsize
    with tempfile.TemporaryDirectory(dir=RAM) as local:
        root = os.path.join(local, "run", "local")  # made at the first local save
        placement.check_size(root, size // 6 + 1, 1, 2, snapshot=False)  # 2 x 3 x share > size
        placement.check_size(root, size, 1, 2, snapshot=False)
    assert len(caplog.records) == 1 and "local_max_to_keep=2" in caplog.text


@needs_ram_disk
def test_a_ram_disk_that_holds_the_tier_is_not_warned_of(caplog):
    caplog.set_level(logging.WARNING)
    size = os.statvfs(RAM).f_blocks * os.statvfs(RAM).f_frsize
    with tempfile.TemporaryDirectory(dir=RAM) as local:
        placement.check_size(local, size // 8, 1, 2, snapshot=True)  # 2 x 3 x share + share < size
    assert "RAM disk" not in caplog.text
