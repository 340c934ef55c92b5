"""The measuring scripts of issue 21 run end to end at a tiny size: benchmarks/pod_scale.py with
real JAX processes, benchmarks/leader_commit_bench.py on synthetic indexes. What they measure
is not asserted (timings are the machine's); that every reported field is there, and that
the restored values and the committed pieces were checked against what was saved, is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _run(script: str, *args: str, tmp_path) -> tuple[str, dict]:
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable, os.path.join(SCRIPTS, script), *args,
            "--dir", str(tmp_path), "--json", str(out), "--timeout", "120",
        ],
        capture_output=True, text=True, timeout=420,  # a hang guard: a loaded 2-core machine is slow
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out.read_text())


def test_pod_scale_runs_several_processes_and_checks_the_restore(tmp_path):
    stdout, summary = _run(
        "pod_scale.py", "--processes", "2", "--devices-per-process", "2", "--leaves", "8", tmp_path=tmp_path
    )
    runs = summary["runs"]
    assert sorted(runs) == ["1", "2"]
    # the one-process baseline runs as 2 one-process jobs side by side, sharing the cores as the 2 processes did
    assert runs["1"]["concurrent_jobs"] == 2 and runs["2"]["concurrent_jobs"] == 1
    for processes, run in runs.items():
        assert run["pieces"] == int(processes) * 2 * 8
        jobs = run["concurrent_jobs"]
        in_order = list(range(int(processes))) * jobs
        assert [r["process"] for r in run["save"]] == [r["process"] for r in run["restore"]] == in_order
        for saved in run["save"]:
            assert saved["pieces"] == 2 * 8  # this process's devices' pieces
            for stage in ("planning", "save"):
                assert {"wall_s", "cpu_s", "rss_growth_mb"} <= set(saved[stage])
        leaders = [r for r in run["save"] if r["commit"]]
        assert [r["process"] for r in leaders] == [0] * jobs
        assert {"wall_s", "cpu_s", "rss_growth_mb"} <= set(leaders[0]["commit"])
        for restored in run["restore"]:
            # each restoring host reads the rows of its own cells (in runs: at most twice their
            # 16 bytes a piece) and builds their entries only: its share, whatever the pod
            own = run["pieces"] // int(processes)
            assert restored["entries"] == own
            assert 16 * own <= restored["table_bytes"] <= 2 * 16 * own
            assert restored["checked_shards"] == 3 * 2  # first, middle, last leaf: each of its 2 local shards
            assert restored["objects"] == run["files"]["count"]
            assert {"wall_s", "cpu_s", "rss_growth_mb"} <= set(restored["restore"])
            for target, check in restored["check_restore"].items():  # issue 25: from the manifest and tables alone
                assert check["data_bytes_read"] == check["data_files_opened"] == 0 < check["control_bytes_read"], check
                assert check["processes_reported"] == int(processes) and check["planned_bytes"] == 16 * own
                assert check["resharded_leaves"] == (8 if target == "other" else 0)
    senders = [r for r in runs["2"]["save"] if r["sent_to_leader_bytes"]]
    assert [r["process"] for r in senders] == [1]  # only the non-leader sends an index
    assert set(summary["ratios"]) >= {"planning_cpu_s", "save_blocking_cpu_s", "save_rss_growth_others_mb",
                                      "save_rss_growth_leader_but_commit_mb", "commit_cpu_s", "restore_cpu_s",
                                      "table_bytes_read", "entries_built"}
    assert summary["ratios"]["entries_built"] == 1.0
    assert "restored shards compared bit for bit: 12" in stdout  # the 2-process job; each baseline job compares 6
    assert "(2 such jobs side by side)" in stdout
    assert "data bytes read and data files opened, all processes: 0 (target 0) PASS" in stdout


def test_leader_commit_bench_commits_synthetic_indexes(tmp_path):
    stdout, summary = _run(
        "leader_commit_bench.py", "--processes", "3", "--devices-per-process", "2", "--leaves", "5", tmp_path=tmp_path
    )
    assert summary["pieces"] == 3 * 2 * 5
    assert summary["index_bytes_total"] > 0
    commit = summary["commit"]
    assert {"wall_s", "cpu_s", "rss_growth_mb", "manifest_and_table_bytes"} <= set(commit)
    assert commit["checked_pieces"] == 2 * 3 * 2  # the first and the last leaf, every process's pieces
    assert sorted(summary["stages"]) == ["decode", "encode", "merge_and_tiling"]
    for stage in summary["stages"].values():
        assert {"wall_s", "cpu_s", "rss_growth_mb", "us_per_piece_cpu"} <= set(stage)
    assert "30 pieces" in stdout
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tpu_ckpt_")]  # the scratch directory is gone
