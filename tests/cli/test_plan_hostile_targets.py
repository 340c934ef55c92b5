"""tpu-ckpt plan --target on hostile or odd target files (issue #39): each is one line on
stderr and exit status 2, never a hang, a traceback, unbounded memory or a shape read wrong.
The file is read only when it is a regular file of bounded size; its JSON nesting, its tree
of keys, its meshes' device count and its shapes are checked before JAX is asked for anything."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import cli
from tpu_ckpt.cli import _plan as cli_plan

TPU_CKPT = os.path.join(os.path.dirname(sys.executable), "tpu-ckpt")


@pytest.fixture
def ckpt(tmp_path):
    tc.save(tmp_path / "ckpt", {"w": np.zeros(4, np.float32)}).wait()
    return str(tmp_path / "ckpt")


def plan_of(capsys, ckpt, target):
    status = cli.main(["plan", ckpt, "--target", str(target)])
    out = capsys.readouterr()
    assert status == 2 and out.out == "" and len(out.err.splitlines()) == 1, out
    return out.err


def test_a_fifo_is_refused_without_waiting_for_a_writer(capsys, tmp_path, ckpt):
    fifo = tmp_path / "target.json"
    os.mkfifo(fifo)
    assert "is not a regular file" in plan_of(capsys, ckpt, fifo)


def test_a_link_to_a_device_is_refused_unread(capsys, tmp_path, ckpt):
    link = tmp_path / "target.json"
    link.symlink_to("/dev/zero")
    assert "is not a regular file" in plan_of(capsys, ckpt, link)


def test_a_file_over_the_size_bound_is_refused(capsys, tmp_path, ckpt, monkeypatch):
    monkeypatch.setattr(cli_plan, "MAX_TARGET_BYTES", 1 << 10)
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"leaves": {f"w{i}": {"shape": [4], "dtype": "float32"} for i in range(100)}}))
    assert "is larger than a target file may be" in plan_of(capsys, ckpt, target)


def test_deeply_nested_json_is_a_typed_error_not_a_recursion_error(capsys, tmp_path, ckpt):
    target = tmp_path / "target.json"
    target.write_text('{"leaves": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in plan_of(capsys, ckpt, target)


@pytest.mark.parametrize(
    "leaves",
    [
        {"params": 1, "params/w": {"shape": [4], "dtype": "float32"}},
        {"params/w": {"shape": [4], "dtype": "float32"}, "params": 1},
    ],
    ids=["leaf first", "subtree first"],
)
def test_a_key_both_leaf_and_subtree_is_a_typed_error(capsys, tmp_path, ckpt, leaves):
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"leaves": leaves}))
    assert "'params' is both a leaf and a subtree" in plan_of(capsys, ckpt, target)


@pytest.mark.parametrize(
    "shape", [[64.7, 32], [True, 4], [-1, 4], "64"], ids=["fraction", "bool", "negative", "string"]
)
def test_a_shape_of_anything_but_whole_numbers_is_refused(capsys, tmp_path, ckpt, shape):
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"leaves": {"w": {"shape": shape, "dtype": "float32"}}}))
    assert "leaf 'w': a shape is a list of whole numbers" in plan_of(capsys, ckpt, target)


@pytest.mark.parametrize("devices", [65536, 2**20, 2**40])
def test_a_mesh_of_more_devices_than_the_bound_is_refused_before_jax_is_asked(tmp_path, ckpt, devices):
    """Run bare, as a user would: the command refuses before XLA is given the device count
    (which grew memory without bound, or printed XLA's flag table, before)."""
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"mesh": {"data": devices}, "leaves": {"w": {"shape": [4], "dtype": "float32"}}}))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [TPU_CKPT, "plan", ckpt, "--target", str(target)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == [
        f"tpu-ckpt: error: {target}: a mesh of {devices} devices is more than plan builds "
        f"({cli_plan.MAX_PLAN_DEVICES} CPU devices at most); plan the restore of a smaller mesh, or of a subtree "
        "whose leaves need fewer devices"
    ]
