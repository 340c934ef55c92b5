"""Exporting to Orbax (tc.export_orbax, tpu-ckpt export-orbax) what Orbax can and cannot hold:
typed PRNG keys go over as Orbax's typed keys; a tc.PerProcess leaf (one value per process,
of which Orbax would keep one) and a bytes leaf (Orbax's StandardCheckpointer refuses them)
are refused before anything is written, with an error naming the key — never dropped."""

import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tpu_ckpt as tc
from tpu_ckpt import cli

W = np.arange(12, dtype=np.float32).reshape(3, 4)


def test_typed_keys_export_as_orbax_typed_keys(tmp_path):
    keys = jax.random.split(jax.random.key(3, impl="rbg"), 4)
    tc.save(tmp_path / "ours", {"w": W, "rng": keys, "step": 5}).wait()
    assert tc.export_orbax(tmp_path / "ours", tmp_path / "theirs") == [str(tmp_path / "theirs")]
    back = ocp.StandardCheckpointer().restore(tmp_path / "theirs")
    assert back["rng"].dtype == keys.dtype  # key<rbg>, bit for bit
    np.testing.assert_array_equal(jax.random.key_data(back["rng"]), jax.random.key_data(keys))
    np.testing.assert_array_equal(back["w"], W)


@pytest.mark.parametrize(
    ("leaf", "says"),
    [
        (tc.PerProcess({"next_index": 96}), "a tc.PerProcess leaf, one value per process (1 saved it)"),
        (b"\x00tok", "a bytes leaf"),
    ],
)
def test_what_orbax_cannot_hold_is_refused_naming_the_key(tmp_path, capsys, leaf, says):
    tc.save(tmp_path / "ours", {"w": W, "data": {"state": leaf}}).wait()
    with pytest.raises(ValueError, match="Leaf 'data/state' of .*ours.* is " + re.escape(says)) as caught:
        tc.export_orbax(tmp_path / "ours", tmp_path / "theirs")
    assert "Nothing was exported" in str(caught.value)
    assert not os.path.exists(tmp_path / "theirs")
    assert cli.main(["export-orbax", str(tmp_path / "ours"), str(tmp_path / "theirs")]) == 2
    assert "'data/state'" in capsys.readouterr().err and not os.path.exists(tmp_path / "theirs")


def test_a_run_directory_is_refused_before_any_step_is_written(tmp_path):
    with tc.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"w": W})
        manager.save(2, {"w": W, "it": tc.PerProcess(b"grain state")})
    with pytest.raises(ValueError, match="Leaf 'it' of .*step_2.* is a tc.PerProcess leaf"):
        tc.export_orbax(tmp_path / "run", tmp_path / "theirs")
    assert not os.path.exists(tmp_path / "theirs") or not os.listdir(tmp_path / "theirs")
