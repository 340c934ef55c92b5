"""export --link of an incremental step (issue #39): its pieces held by an earlier step
(``../step_1/<file>``) cannot be named by a linked checkpoint, which names the files of one
source; before, the export succeeded and wrote names every reader refused. Now it is a
ValueError (exit status 2) naming a held file, and nothing is written."""

import os

import numpy as np

import tpu_ckpt as tc
from tpu_ckpt.cli import main

BASE = np.arange(4096, dtype=np.float32)


def run_of_two_steps(tmp_path):
    with tc.CheckpointManager(tmp_path / "run", max_to_keep=None, incremental=True) as manager:
        for step in (1, 2):
            manager.save(step, {"params": {"base": BASE, "t": np.full(4, step, np.float32)}})
    return tmp_path / "run"


def test_linking_an_incremental_step_is_refused_and_writes_nothing(tmp_path, capsys):
    run = run_of_two_steps(tmp_path)
    status = main(["export", "--link", str(run / "step_2"), str(run / "serve")])
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1, err
    assert f"{run / 'step_2'} is an incremental step: ../step_1/" in err and "export it without --link" in err
    assert not os.path.exists(run / "serve")


def test_an_incremental_step_still_exports_as_a_copy_and_its_first_step_as_a_link(tmp_path):
    run = run_of_two_steps(tmp_path)
    tc.export_for_serving(run / "step_2", run / "copy")
    tc.export_for_serving(run / "step_1", run / "link", link=True)
    for name, t in (("copy", 2), ("link", 1)):
        out = tc.restore(run / name)
        np.testing.assert_array_equal(out["base"], BASE)
        np.testing.assert_array_equal(out["t"], np.full(4, t, np.float32))
