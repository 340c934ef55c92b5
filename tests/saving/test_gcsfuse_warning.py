"""A local save onto a gcsfuse mount warns, once per mount, that its commit (a directory
rename) is atomic only on a hierarchical-namespace bucket, and points at gs://."""

import logging

import numpy as np

import tpu_ckpt as tc
from tpu_ckpt.saving import _staging as staging


def mounts_file(tmp_path, point: str, fstype: str) -> str:
    listing = tmp_path / "mounts"
    listing.write_text(f"/dev/root / ext4 rw 0 0\nbucket {point} {fstype} rw,nosuid 0 0\n")
    return str(listing)


def test_a_path_under_a_gcsfuse_mount_is_found(tmp_path):
    mounts = mounts_file(tmp_path, str(tmp_path / "gcs"), "fuse.gcsfuse")
    assert staging.gcsfuse_mount(str(tmp_path / "gcs" / "run" / "step_1"), mounts) == str(tmp_path / "gcs")
    assert staging.gcsfuse_mount(str(tmp_path / "gcs-other" / "step_1"), mounts) is None
    assert staging.gcsfuse_mount(str(tmp_path / "x"), mounts_file(tmp_path, str(tmp_path), "fuse.sshfs")) is None


def test_the_warning_comes_once_per_mount(tmp_path, caplog):
    mounts = mounts_file(tmp_path, str(tmp_path / "gcs"), "fuse.gcsfuse")
    with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
        staging.warn_if_gcsfuse(str(tmp_path / "gcs" / "a"), mounts)
        staging.warn_if_gcsfuse(str(tmp_path / "gcs" / "b"), mounts)
    warnings = [r.getMessage() for r in caplog.records if "gcsfuse" in r.getMessage()]
    assert len(warnings) == 1 and "hierarchical namespace" in warnings[0] and "gs://" in warnings[0]


def test_a_save_on_this_machine_warns_of_no_gcsfuse(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tpu_ckpt"):
        tc.save(str(tmp_path / "c"), {"x": np.arange(3)}).wait()
    assert not [r for r in caplog.records if "gcsfuse" in r.getMessage()]
