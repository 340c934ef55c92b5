"""The main job (`make demo`) runs end to end and reports a bit-exact restore."""

import os
import subprocess
import sys

import jax
import pytest

import tpu_ckpt as tc

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_script_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--dir", str(tmp_path), "--steps", "30", "--every", "5"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "-- resumed from step 20 onto mesh (2, 4)" in out.stdout  # interrupted at 20, a multiple of 5
    assert "predicts like the live model: True" in out.stdout
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step_20", "step_25", "step_30"]  # max_to_keep=3
    serving = tc.metadata(tmp_path / "serving")
    assert set(serving) == {"params"}  # params only, no optimizer state
    assert {m.dtype.name for m in jax.tree_util.tree_leaves(serving)} == {"bfloat16"}
