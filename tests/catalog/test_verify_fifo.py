"""tpu-ckpt verify on a checkpoint whose data file was replaced by a FIFO (issue #39): the
problem is "unreadable", in the words of the read that refused it (a FIFO, not a regular
file), never "truncated"; and verify does not wait for a writer."""

import os

import numpy as np

import tpu_ckpt as tc
from tests.support.helpers import files
from tpu_ckpt.cli import main


def test_a_fifo_data_file_is_unreadable_not_truncated(tmp_path, capsys):
    tc.save(tmp_path / "c", {"w": np.arange(100.0)}).wait()
    (name,) = files(tmp_path / "c")
    os.remove(tmp_path / "c" / name)
    os.mkfifo(tmp_path / "c" / name)
    assert main(["verify", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"unreadable: {tmp_path / 'c' / name} (key w): "), out
    assert "is a FIFO, not a regular file" in out, out
    assert "truncated" not in out
