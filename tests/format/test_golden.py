"""The format promise (FORMAT.md "Versioning"): every checkpoint a release wrote is read by every
later release, with no flag. tests/format/golden/ holds one small checkpoint of each format this
project has written, made by the commit its README names (make_golden.py); each is restored here
and compared bit for bit with the values that commit saved, and ``verify`` finds nothing wrong."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

import tpu_ckpt as tc
from tests.format.golden.make_golden import GOLDEN, HERE, state
from tpu_ckpt.catalog import verify


def _copy(tmp_path, name):
    """A copy of the golden checkpoint: a reader (or a manager) never touches the committed one."""
    return shutil.copytree(HERE / name, tmp_path / name)


def _host(tree):
    return jax.tree.map(lambda leaf: np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf, tree)


def _assert_bit_exact(restored, expected):
    """Same tree, and every leaf the same dtype, shape and bytes (a Python value: equal)."""
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(_host(restored)), jax.tree.leaves(_host(expected)), strict=True):
        if isinstance(want, np.ndarray):
            got = np.asarray(got)
            assert (got.dtype, got.shape) == (want.dtype, want.shape)
            assert got.tobytes() == want.tobytes()
        else:
            assert got == want and type(got) is type(want)


def _verified(path):
    report = verify(path)
    assert report.ok, report.problems
    assert report.leaves == 5
    return report


def test_every_golden_checkpoint_is_here_with_the_commit_that_wrote_it():
    readme = (HERE / "README.md").read_text()
    for name, (commit, _, _) in GOLDEN.items():
        assert (HERE / name).is_dir(), name
        assert f"| `{name}` | `{commit}` |" in readme, name


@pytest.mark.parametrize("name", ["format-1.0", "format-1.1", "format-1.2", "format-2.0"])
def test_a_format_version_restores_bit_exactly(tmp_path, name):
    path = _copy(tmp_path, name)
    version = name.removeprefix("format-")
    assert json.loads((path / "manifest.json").read_text())["format_version"] == version
    _assert_bit_exact(tc.restore(path), state(0))
    expected = state(0)
    target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
                          if isinstance(leaf, jax.Array) else leaf, expected)
    restored = tc.restore(path, target)
    assert restored["params"]["w"].sharding == expected["params"]["w"].sharding
    _assert_bit_exact(restored, expected)
    _verified(path)


def test_an_incremental_step_restores_through_its_reference_to_a_retired_step(tmp_path):
    run = _copy(tmp_path, "incremental")
    assert not (run / "step_0" / "manifest.json").exists()
    assert json.loads((run / "step_1" / "manifest.json").read_text())["files"][0][0].startswith("../step_0/")
    _assert_bit_exact(tc.restore(run / "step_1"), state(1))
    _verified(run / "step_1")
    with tc.CheckpointManager(run, incremental=True) as manager:
        assert manager.all_steps() == [1]
        _assert_bit_exact(manager.restore(), state(1))


def test_a_local_tier_step_restores_from_the_local_tier(tmp_path):
    root = _copy(tmp_path, "local-tier")
    assert not (root / "run" / "step_1").exists()
    with tc.CheckpointManager(root / "run", local_directory=root / "local") as manager:
        _assert_bit_exact(manager.restore(), state(1))
    _assert_bit_exact(tc.restore(root / "run" / "step_0"), state(0))
    _verified(root / "run" / "step_0")


def test_a_serving_export_and_a_linked_export_restore(tmp_path):
    root = _copy(tmp_path, "serving")
    params = _host(state(0)["params"])
    bf16 = {key: value.astype(ml_dtypes.bfloat16) for key, value in params.items()}
    _assert_bit_exact(tc.restore(root / "serving"), bf16)
    _assert_bit_exact(tc.restore(root / "linked"), params)
    for name in ("serving", "linked"):
        report = verify(root / name)
        assert report.ok and report.leaves == 2, report.problems
