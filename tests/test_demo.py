"""The main job (`make demo`) runs end to end and reports a bit-exact restore."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_script_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--dir", str(tmp_path), "--steps", "10", "--every", "5"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical to the live state: True" in out.stdout
    assert sorted(os.listdir(tmp_path)) == ["step_10", "step_5"]
