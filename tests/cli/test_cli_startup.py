"""The commands that read manifests start without importing JAX, ml_dtypes or tensorstore (#27).

Those imports cost seconds of CPU on a loaded machine; ls, inspect, verify, diff and gc only
need the manifest's dtype names and sizes, never a dtype object. Timing lives in
benchmarks/benchmark.py ("CLI start-up"); here only which modules got imported.
"""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.format import dtype_itemsize

PROBE = """
import json, sys
from tpu_ckpt import cli
status = cli.main(json.loads(sys.argv[1]))
print(json.dumps([status, sorted(m for m in ("jax", "ml_dtypes", "tensorstore") if m in sys.modules)]))
"""


def state(fill: int, bf16: int = 0) -> dict:
    """Numpy and ml_dtypes leaves: the names a command must size without importing ml_dtypes."""
    return {
        "w": np.full((4, 3), fill, np.float32),
        "bf16": np.arange(6).astype(ml_dtypes.bfloat16) + bf16,
        "int4": np.arange(5).astype(ml_dtypes.int4),
        "fp8": np.ones(3, ml_dtypes.float8_e4m3fn),
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("startup")
    tc.save(directory / "step_1", state(1))
    tc.save(directory / "step_2", state(2))
    tc.save(directory / "step_3", state(2, bf16=1))
    return directory


@pytest.mark.parametrize(
    "command",
    [
        ["ls", "{d}"], ["inspect", "{d}/step_1"], ["inspect", "{d}/step_1", "--json"], ["verify", "{d}/step_1"],
        ["diff", "{d}/step_1", "{d}/step_2", "--values"], ["gc", "{d}", "--dry-run"],
    ],
    ids=lambda c: " ".join(a for a in c if "{" not in a),
)
def test_manifest_commands_import_neither_jax_nor_ml_dtypes_nor_tensorstore(run_dir, command):
    argv = [a.format(d=run_dir) for a in command]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=120
    )
    status, imported = json.loads(result.stdout.splitlines()[-1])
    assert imported == [], result.stdout + result.stderr
    assert status == (1 if command[0] == "diff" else 0), result.stdout + result.stderr  # diff: the values differ


def test_diff_values_measures_a_bfloat16_difference_importing_ml_dtypes_then_only(run_dir):
    """Equal bfloat16 bits compare as bytes; a difference needs the dtype to say how large it is."""
    argv = ["diff", f"{run_dir}/step_2", f"{run_dir}/step_3", "--values"]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=120
    )
    assert "bf16  data differs in 6 of 6 elements, max abs diff 1" in result.stdout, result.stdout + result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [1, ["ml_dtypes"]]


def test_an_unknown_dtype_name_is_a_format_version_error_without_ml_dtypes():
    with pytest.raises(tc.FormatVersionError, match="'float128x'"):
        dtype_itemsize("float128x")
