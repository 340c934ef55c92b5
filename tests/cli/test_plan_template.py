"""`tpu-ckpt plan CKPT --template` prints CKPT's own layout as a --target file, which plans as-saved."""

import json
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tpu_ckpt", *map(str, args)], capture_output=True, text=True)


def test_the_template_is_the_saved_layout_and_plans_as_saved(tmp_path, mesh42):
    w = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh42, P("data", "model")))
    tree = {"p": {"w": w, "host": np.arange(3)}, "it": tc.PerProcess({"i": 1}), "step": 3, "name": "x"}
    tc.save(tmp_path / "c", tree).wait()
    shown = _cli("plan", tmp_path / "c", "--template")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc == {
        "mesh": {"data": 4, "model": 2},
        "leaves": {
            "p/host": {"shape": [3], "dtype": "int64", "spec": []},
            "p/w": {"shape": [8, 4], "dtype": "float32", "spec": ["data", "model"]},
            "step": 3,
            "name": "x",
        },
    }
    (tmp_path / "t.json").write_text(shown.stdout)
    planned = _cli("plan", tmp_path / "c", "--target", tmp_path / "t.json")
    assert planned.returncode == 0 and "as saved" in planned.stdout, planned.stdout + planned.stderr
    template = json.loads(_cli("plan", tmp_path / "c", "--template", "--subtree", "p").stdout)
    assert template["leaves"].keys() == {"host", "w"}
