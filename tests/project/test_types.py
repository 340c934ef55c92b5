"""The library's types agree with its design: `mypy tpu_ckpt` (pyproject.toml's [tool.mypy])
reports nothing, as `make lint` requires. Narrow protocols (read-only store < checkpoint store
< backend), the write callbacks' one shape and the sharding callbacks' ``arrangement`` mean
something only while a checker holds the code to them."""

import os
import pathlib
import subprocess
import sys

import pytest

import tpu_ckpt as tc
from tpu_ckpt.options import path_callbacks

ROOT = pathlib.Path(tc.__file__).parents[1]


@pytest.mark.slow  # a minute without mypy's cache (it reads jax's and numpy's types), a second with it
def test_mypy_reports_no_error():
    mypy = os.path.join(os.path.dirname(sys.executable), "mypy")
    result = subprocess.run([mypy, "tpu_ckpt"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_write_callbacks_are_run_in_one_shape_told_when_the_options_are_built():
    """Both shapes users give (TF's contract: one taking an argument gets the path) become
    one: a save calls each with the path, and never inspects a callback itself."""
    calls: list[str] = []

    def with_path(path: str, tag: str = "default") -> None:
        calls.append(f"path {path} {tag}")

    options = tc.CheckpointOptions(write_callbacks=[lambda: calls.append("plain"), with_path, lambda **kw: calls.append(f"kw {kw}")])
    for callback in path_callbacks(options.replace(enable_async=True)):
        callback("/ckpt/7")
    assert calls == ["plain", "path /ckpt/7 default", "kw {}"]
