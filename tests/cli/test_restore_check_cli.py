"""tpu-ckpt plan: check_restore from a shell, on a target from another checkpoint (--like)
or a JSON file (--target); exit 0 when the restore would succeed, 1 when not, 2 on bad input."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tpu_ckpt import cli

W = np.arange(64, dtype=np.float32).reshape(8, 8)
TPU_CKPT = os.path.join(os.path.dirname(sys.executable), "tpu-ckpt")


def save(path, mesh, spec, w=W):
    params = {"w": jax.device_put(w, NamedSharding(mesh, spec)), "i": np.arange(4)}
    tc.save(str(path), {"params": params, "step": 7}).wait()
    return str(path)


@pytest.fixture
def ckpt(tmp_path, mesh42):
    return save(tmp_path / "ckpt", mesh42, P("data", "model"))


def plan(capsys, *argv):
    status = cli.main(["plan", *map(str, argv)])
    out = capsys.readouterr()
    return status, out.out, out.err


def write_target(tmp_path, leaves, mesh=None):
    path = tmp_path / "target.json"
    path.write_text(json.dumps({"leaves": leaves, **({"mesh": mesh} if mesh else {})}))
    return path


def test_like_another_checkpoint_on_another_mesh(capsys, tmp_path, ckpt, mesh24):
    other = save(tmp_path / "other", mesh24, P(None, "model"))
    status, out, _ = plan(capsys, ckpt, "--like", other)
    assert status == 0 and out.startswith(f"restore of {ckpt}: ok\n")
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("params/w "))
    assert lines[at].split()[:2] == ["params/w", "resharded"]
    assert lines[at + 1] == "  float32[8, 8] data=4,model=2 P(data,model) -> float32 data=2,model=4 P(None,model)"
    assert max(map(len, lines[1:])) <= 100  # the first names the checkpoint, however long its path
    assert out.splitlines()[-2].split()[:2] == ["PROCESS", "READ"]
    w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh24, P(None, "model")))
    same = {"params": {"w": w, "i": np.arange(4)}}
    requests = tc.check_restore(ckpt, same).requests_per_process[0]  # as the library counts them
    assert out.splitlines()[-1].split()[:4] == ["0", str(W.nbytes + np.arange(4).nbytes), "B", str(requests)]


def test_like_a_checkpoint_of_another_shape_fails_with_exit_1(capsys, tmp_path, ckpt, mesh24):
    other = save(tmp_path / "other", mesh24, P(None, "model"), w=np.zeros((8, 4), np.float32))
    status, out, err = plan(capsys, ckpt, "--like", other)
    assert status == 1 and err == ""
    first, *problem = out.splitlines()  # the problem wrapped at 100 columns
    assert first == f"restore of {ckpt}: would fail (1 problem)"
    assert problem[0].startswith("  Target leaf 'params/w'") and max(map(len, problem)) <= 100
    assert " ".join(" ".join(problem).split()) == (
        f"Target leaf 'params/w' has shape (8, 4) but checkpoint {ckpt} saved (8, 8)"
    )


def test_target_file_with_json_output(capsys, tmp_path, ckpt):
    leaves = {"params/w": {"shape": [8, 8], "dtype": "bfloat16", "spec": ["data", "model"]}, "step": 0}
    target = write_target(tmp_path, leaves, mesh={"data": 2, "model": 4})
    status, out, _ = plan(capsys, ckpt, "--target", target, "--json", "--devices-per-process", 4, "--throughput", 100)
    doc = json.loads(out)
    assert status == 0 and doc["ok"] and doc["problems"] == []
    assert doc["casts"] == ["params/w: float32 -> bfloat16"] and doc["unread_keys"] == ["params/i"]
    assert doc["reads"] == {
        str(p): {"nbytes": W.nbytes // 2, "requests": 4, "over_read": 0, "seconds": W.nbytes / 2 / 100e6}
        for p in (0, 1)
    }
    assert [leaf["key"] for leaf in doc["leaves"]] == ["params/w"] and doc["leaves"][0]["resharded"]


def test_target_file_under_a_subtree_listing_every_problem(capsys, tmp_path, ckpt):
    leaves = {
        "w": {"shape": [8, 8], "dtype": "float32"}, "i": {"shape": [4], "dtype": "float32"},
        "b": {"shape": [2], "dtype": "float32"},
    }
    status, out, _ = plan(capsys, ckpt, "--subtree", "params", "--target", write_target(tmp_path, leaves), "--json")
    doc = json.loads(out)
    assert status == 1 and not doc["ok"]
    assert [p.split("'")[1] for p in doc["problems"]] == ["params/b", "params/i"]


@pytest.mark.parametrize(
    "content, words",
    [
        ("{not json", "is not JSON"),
        ('{"mesh": {"data": 2}}', 'must hold an object with "leaves"'),
        ('{"leaves": {"w": {"shape": [8, 8]}}}', "leaf 'w'"),
        ('{"leaves": {"w": {"shape": [8, 8], "dtype": "float99"}}}', "leaf 'w'"),
        ('{"mesh": {"data": 64}, "leaves": {"w": {"shape": [64], "dtype": "float32"}}}', "needs 64 devices"),
        (
            '{"mesh": {"data": 2}, "leaves": {"w": {"shape": [8, 8], "dtype": "float32", "spec": ["data", "data"]}}}',
            "duplicate",
        ),
    ],
    ids=["not json", "no leaves", "no dtype", "unknown dtype", "too many devices", "axis used twice"],
)
def test_a_bad_target_file_is_one_line_and_exit_2(capsys, tmp_path, ckpt, content, words):
    target = tmp_path / "target.json"
    target.write_text(content)
    status, out, err = plan(capsys, ckpt, "--target", target)
    assert status == 2 and out == "" and len(err.splitlines()) == 1 and words in err, err


def test_no_checkpoint_is_exit_2(capsys, tmp_path, ckpt):
    status, _, err = plan(capsys, tmp_path / "nothing", "--like", ckpt)
    assert status == 2 and err.startswith("tpu-ckpt: error: ")


@pytest.mark.slow
def test_the_console_script_makes_the_cpu_devices_the_mesh_needs(tmp_path, ckpt):
    """Run bare (no XLA_FLAGS): the command itself asks JAX for the 8 CPU devices."""
    leaves = {"params/w": {"shape": [8, 8], "dtype": "float32", "spec": ["data", "model"]}}
    target = write_target(tmp_path, leaves, mesh={"data": 2, "model": 4})
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [TPU_CKPT, "plan", ckpt, "--target", str(target)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0 and result.stdout.startswith(f"restore of {ckpt}: ok"), result.stdout + result.stderr


def test_target_keys_name_list_entries_too(capsys, tmp_path):
    path = str(tmp_path / "layers")
    tc.save(path, {"layers": [np.zeros(2), np.ones(3)]}).wait()
    target = write_target(tmp_path, {"layers/1": {"shape": [3], "dtype": "float64"}})
    status, out, _ = plan(capsys, path, "--target", target, "--json")
    doc = json.loads(out)
    assert status == 0 and [x["key"] for x in doc["leaves"]] == ["layers/1"] and doc["unread_keys"] == ["layers/0"]
