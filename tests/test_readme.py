"""The README's first example runs as written (the others assume a training loop around them)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_and_restore_example_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        first = re.findall(r"```python\n(.*?)```", f.read(), re.S)[0]
    script = first.replace("/tmp/ckpts", str(tmp_path / "ckpts"))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ArrayMetadata(shape=(8, 4)" in out.stdout
    assert os.path.exists(tmp_path / "ckpts" / "step_100" / "manifest.json")
