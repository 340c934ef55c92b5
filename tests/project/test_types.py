"""The library's types agree with its design (`mypy tpu_ckpt`, pyproject.toml's [tool.mypy],
is run by `make lint`, the last step of `make test`, not here: a cold run costs half a minute
of the suite). Narrow protocols (read-only store < checkpoint store
< backend), the write callbacks' one shape and the sharding callbacks' ``arrangement`` mean
something only while a checker holds the code to them."""

import pathlib

import tpu_ckpt as tc
from tpu_ckpt.options import path_callbacks

ROOT = pathlib.Path(tc.__file__).parents[1]


def test_write_callbacks_are_run_in_one_shape_told_when_the_options_are_built():
    """Both shapes users give (TF's contract: one taking an argument gets the path) become
    one: a save calls each with the path, and never inspects a callback itself."""
    calls: list[str] = []

    def with_path(path: str, tag: str = "default") -> None:
        calls.append(f"path {path} {tag}")

    options = tc.CheckpointOptions(
        write_callbacks=[lambda: calls.append("plain"), with_path, lambda **kw: calls.append(f"kw {kw}")]
    )
    for callback in path_callbacks(options.replace(enable_async=True)):
        callback("/ckpt/7")
    assert calls == ["plain", "path /ckpt/7 default", "kw {}"]
