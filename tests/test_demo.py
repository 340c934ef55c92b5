"""The main job (`make demo`) runs end to end and reports a bit-exact restore."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_script_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--dir", str(tmp_path), "--steps", "30", "--every", "5"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "-- resumed from step 16 onto mesh (2, 4)" in out.stdout
    assert "predicts like the live model: True" in out.stdout
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step_21", "step_26", "step_30"]  # max_to_keep=3
    assert sorted(os.listdir(tmp_path / "serving")) == ["d00000-00000.safetensors", "d00000-00001.safetensors",
                                                         "d00000-00002.safetensors", "d00000-00003.safetensors",
                                                         "d00000-00004.safetensors", "d00000-00005.safetensors",
                                                         "d00000-00006.safetensors", "d00000-00007.safetensors",
                                                         "d00000-00008.safetensors", "manifest.json"]
