"""The main job (`make demo`) runs end to end and reports a bit-exact restore."""

import os
import re
import shlex
import subprocess
import sys

import jax
import pytest

import tpu_ckpt as tc

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_script_runs_and_keeps_the_checkpoints_it_names(tmp_path):
    """Without --dir it works in a fresh temporary directory (under TMPDIR, here tmp_path),
    which it keeps and names at the end: a newcomer can look at what it printed."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--steps", "30", "--every", "5"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "-- resumed from step 20 onto mesh (2, 4)" in out.stdout  # interrupted at 20, a multiple of 5
    assert "predicts like the live model: True" in out.stdout
    kept = re.search(r"^-- kept in (\S+): ", out.stdout, re.MULTILINE)
    assert kept, out.stdout
    root = kept.group(1)
    assert os.path.dirname(root) == str(tmp_path)
    assert f"checkpoints in {os.path.join(root, 'ckpts')}" in out.stdout
    assert sorted(os.listdir(os.path.join(root, "ckpts"))) == ["step_20", "step_25", "step_30"]  # max_to_keep=3
    hint = re.search(r"look with `(.+) ls (\S+)`", out.stdout)
    assert hint and hint.group(2) == os.path.join(root, "ckpts"), out.stdout
    # the hint works as printed, without the virtualenv on PATH (`make demo` never activates it)
    listing = subprocess.run(
        [*shlex.split(hint.group(1)), "ls", hint.group(2)], capture_output=True, text=True, timeout=120,
        cwd=os.getcwd(), env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert listing.returncode == 0 and "step_30" in listing.stdout, listing.stdout + listing.stderr
    serving = tc.metadata(os.path.join(root, "serving"))
    assert set(serving) == {"params"}  # params only, no optimizer state
    assert {m.dtype.name for m in jax.tree_util.tree_leaves(serving)} == {"bfloat16"}
