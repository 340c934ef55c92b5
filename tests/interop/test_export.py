"""export_for_serving: params-only copies, casts, re-sharding, and zero-copy links."""

import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax.training import train_state

import tpu_ckpt as tc
from tests.support.helpers import files, manifest
from tpu_ckpt.settings import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAMS = {
    "dense": {"kernel": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "bias": np.ones(32, np.float32)},
    "ids": np.arange(4),
}


@pytest.fixture
def training(tmp_path):
    state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.adam(1e-3))
    tc.save(tmp_path / "train", state)
    return tmp_path / "train"


def test_copy_writes_params_only(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "serve")
    out = tc.restore(tmp_path / "serve")
    assert set(out) == {"dense", "ids"}
    np.testing.assert_array_equal(out["dense"]["kernel"], PARAMS["dense"]["kernel"])
    assert not any("opt_state" in leaf["key"] for leaf in manifest(tmp_path / "serve")["leaves"])


def test_cast_to_bfloat16_keeps_ints(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "serve", dtype="bfloat16")
    out = tc.restore(tmp_path / "serve")
    assert out["dense"]["kernel"].dtype == ml_dtypes.bfloat16 and out["ids"].dtype == np.int64
    np.testing.assert_array_equal(out["dense"]["bias"].astype(np.float32), np.ones(32, np.float32))
    with pytest.raises(ValueError, match="float type"):
        tc.export_for_serving(training, tmp_path / "bad", dtype="int8")


def test_max_shard_size_recuts_the_files(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "serve", max_shard_size=1024)
    assert len(files(tmp_path / "serve")) >= 8  # 8 KiB of kernel in 1 KiB files
    np.testing.assert_array_equal(tc.restore(tmp_path / "serve")["dense"]["kernel"], PARAMS["dense"]["kernel"])


def test_link_copies_no_data_and_checks_its_source(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "serve", link=True)
    assert sorted(os.listdir(tmp_path / "serve")) == ["manifest.json", "pieces-00000.bin"]
    out = tc.restore(tmp_path / "serve", {"dense": {"kernel": jnp.zeros((64, 32))}})
    np.testing.assert_array_equal(np.asarray(out["dense"]["kernel"]), PARAMS["dense"]["kernel"])
    moved = tmp_path / "elsewhere"
    shutil.move(training, moved)
    with pytest.raises(tc.CheckpointNotFoundError, match="linked checkpoint.*no longer exists"):
        tc.restore(tmp_path / "serve")
    shutil.move(moved, training)
    tc.restore(tmp_path / "serve")  # valid again once the source is back


def test_link_detects_a_changed_source(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "serve", link=True)
    shutil.rmtree(training)
    tc.save(training, {"params": PARAMS})  # a different checkpoint under the same name
    with pytest.raises(tc.CorruptCheckpointError, match="has changed"):
        tc.restore(tmp_path / "serve")


def test_link_refuses_options_that_need_a_rewrite(training, tmp_path):
    with pytest.raises(ValueError, match="cannot also change"):
        tc.export_for_serving(training, tmp_path / "serve", link=True, dtype="bfloat16")


def test_cli_export(training, tmp_path):
    script = [sys.executable, "-m", "tpu_ckpt", "export"]
    ok = subprocess.run(
        [*script, str(training), str(tmp_path / "s"), "--dtype", "bfloat16"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert "wrote" in ok.stdout
    bad = subprocess.run(
        [*script, str(training), str(tmp_path / "s2"), "--subtree", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "subtree 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_copy_reports_progress_in_batches(training, tmp_path):
    calls = []
    tc.export_for_serving(training, tmp_path / "serve", progress=lambda done, total: calls.append((done, total)))
    total = PARAMS["dense"]["kernel"].nbytes + PARAMS["dense"]["bias"].nbytes + PARAMS["ids"].nbytes
    assert calls[-1] == (total, total) and all(d <= t for d, t in calls)
    assert settings().read_batch_bytes >= total  # one batch here: a single report


def test_cli_export_draws_a_progress_bar_on_a_terminal(training, tmp_path):
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpu_ckpt", "export", str(training), str(tmp_path / "s")],
        stdout=subprocess.PIPE, stderr=follower,
    )
    os.close(follower)
    out, _ = proc.communicate(timeout=120)
    chunks = b""
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:
            break
        if not data:
            break
        chunks += data
    os.close(leader)
    assert proc.returncode == 0
    assert b"copying [########################################]" in chunks


def test_a_link_outside_its_sources_directory_is_refused(training, tmp_path):
    """A linked checkpoint names only ``../<sibling>/<file>`` (FORMAT.md), so a reader can
    confine every name; a link anywhere else would need ``../../...``."""
    with pytest.raises(ValueError, match="beside"):
        tc.export_for_serving(training, tmp_path / "deeper" / "serve", link=True)
    assert not (tmp_path / "deeper" / "serve").exists()


def test_a_link_to_a_link_is_refused(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "serve", link=True)
    with pytest.raises(ValueError, match="itself a linked checkpoint"):
        tc.export_for_serving(tmp_path / "serve", tmp_path / "serve2", link=True, subtree="")
