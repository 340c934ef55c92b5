"""Issue #27, what a newcomer met in the command's output: small sizes printed as ``0.0 MB``."""

import io

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import cli
from tpu_ckpt.runtime import Progress, size


@pytest.mark.parametrize(
    "nbytes, shown",
    [
        (0, "0 B"), (72, "72 B"), (999, "999 B"), (1000, "1.0 KB"), (1500, "1.5 KB"), (40_000, "40.0 KB"),
        (999_999, "1.0 MB"), (12_345_678, "12.3 MB"), (2.5e12, "2.5 TB"), (5e15, "5000.0 TB"),
    ],
)
def test_sizes_are_shown_in_a_unit_that_keeps_their_digits(nbytes, shown):
    assert size(nbytes) == shown


def test_export_of_a_small_checkpoint_prints_its_bytes_not_zero_megabytes(tmp_path, capsys):
    tc.save(tmp_path / "src", {"params": {"w": np.arange(32, dtype=np.float32).reshape(8, 4)}}).wait()
    status = cli.main(["export", str(tmp_path / "src"), str(tmp_path / "serving"), "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert status == 0
    assert out.startswith(f"wrote {tmp_path / 'serving'}: 64 B in "), out  # 32 bfloat16 values


def test_the_progress_bar_shows_small_sizes_in_their_unit():
    """The bar's amounts use the commands' size format: a 72-byte export is not 0.0/0.0 MB."""
    stream = io.StringIO()
    stream.isatty = lambda: True  # drawn as on a terminal
    with Progress("copying", 72, stream=stream) as bar:
        bar(72, 72)
    assert "72 B/72 B" in stream.getvalue() and "0.0/0.0 MB" not in stream.getvalue()
