"""Multi-process save/restore with real JAX processes (2 x 4 CPU devices, gloo)."""

import os

from tests import helpers, multiprocess


def test_two_processes_save_and_restore_across_meshes(tmp_path):
    results = multiprocess.run("save_and_restore_across_meshes", 2, str(tmp_path))
    for r in results:
        assert r.returncode == 0, r.output
        res = r.result
        assert res["w_ok"] and res["replicated_ok"] and res["numpy_ok"] and res["big_ok"], res
        assert res["step"] == 42
        assert res["needs_other_process_pieces"], res
    assert "altered task" in results[0].result["altered_task_error"]
    assert "'replicated'" in results[0].result["altered_task_error"]
    files = results[0].result["files"]
    assert any(f.startswith("d00000-") for f in files) and any(f.startswith("d00001-") for f in files)
    assert helpers.manifest(tmp_path / "ckpt")["process_count"] == 2
    w = helpers.leaf(tmp_path / "ckpt", "w")
    assert len(w["pieces"]) == 8 and {p["file"][:6] for p in w["pieces"]} == {"d00000", "d00001"}
    assert len(helpers.leaf(tmp_path / "ckpt", "replicated")["pieces"]) == 1  # written once across the job
    # A big block both processes hold is split between them: each writes half of it.
    big = helpers.leaf(tmp_path / "ckpt", "big_replicated")["pieces"]
    assert sorted((p["file"][:6], p["slice"]) for p in big) == [
        ("d00000", [[0, 512], [0, 2048]]), ("d00001", [[512, 1024], [0, 2048]]),
    ]
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    assert not [f for f in os.listdir(tmp_path / "ckpt") if f.startswith("index-")]


def test_a_failure_on_one_process_reaches_the_other_and_nothing_is_committed(tmp_path):
    results = multiprocess.run("one_process_fails", 2, str(tmp_path))
    assert results[1].result["error"] == "RuntimeError"
    zero = results[0].result
    assert zero["error"] == "RemoteProcessError"
    assert "process 1 failed" in zero["message"] and "callback failed on process 1" in zero["message"]
    assert zero["seconds"] < 90  # told at once, not after the 180 s coordination timeout
    assert os.listdir(tmp_path) == []


def test_a_straggler_is_named_when_the_timeout_passes(tmp_path):
    results = multiprocess.run("straggler", 2, str(tmp_path))
    zero = results[0].result
    assert zero["error"] == "CoordinationTimeoutError", zero
    assert zero["missing"] == [1]
    assert "processes [1] did not reach stage 'written'" in zero["message"]
    assert results[1].result["error"] in ("RemoteProcessError", "CoordinationTimeoutError")
    assert os.listdir(tmp_path) == []


def test_async_save_across_processes_with_buffers_deleted(tmp_path):
    results = multiprocess.run("async_save_with_buffers_deleted", 2, str(tmp_path))
    for r in results:
        assert r.returncode == 0, r.output
        assert r.result["ok"]
    assert os.listdir(tmp_path) == ["ckpt"]
