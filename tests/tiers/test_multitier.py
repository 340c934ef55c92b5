"""Multi-tier CheckpointManager with 4 real JAX processes, each with a private local disk."""

import json
import os

import pytest

from tests.support import process_group
from tests.support.process_group import results_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_local_tier_survives_lost_hosts_and_falls_back_to_the_persistent_tier(tmp_path):
    results = results_of(process_group.run("tiers.tier_scenarios.survivors_and_lost_hosts", 4, str(tmp_path)))
    for me, res in enumerate(results):
        # (e) while step 5 was being uploaded, the local saves of 6 and 7 went on.
        assert {"step_5", "step_6"} <= set(res["while_uploading"]["local"]), res
        assert "step_5" not in res["while_uploading"]["persistent"], res
        assert res["uploaded_same_bytes"], res
        assert res["persistent_steps"] == [1, 5]
        # local_max_to_keep=3 on every host; each holds its own part and its predecessor's.
        assert sorted(res["local"]) == ["step_6", "step_7", "step_8"], res
        owners = sorted({me, (me - 1) % 4})
        for files in res["local"].values():
            assert [f for f in files if f.startswith("index-")] == [f"index-{p:05d}.bin" for p in owners], files
        # (a) all alive, (b) process 2's disk wiped: the local step, no persistent file opened.
        for case in ("all_alive", "one_lost"):
            assert res[case]["step"] == 8 and res[case]["mismatches"] == [], (case, res)
            assert res[case]["persistent_opened"] == [], (case, res)
        # (c) processes 1 and 2 wiped: process 1's part is gone; the persistent step 5.
        assert res["latest_two_lost"] == 5
        assert res["two_lost"]["step"] == 5 and res["two_lost"]["mismatches"] == [], res
        assert any(f.endswith(".safetensors") for f in res["two_lost"]["persistent_opened"]), res
        assert res["plain_restore_mismatches"] == []
        assert res["keys_left"] == []  # every local save, upload and tier restore deleted its keys
    manifest = tmp_path / "persistent" / "step_5" / "manifest.json"
    assert manifest.exists() and not os.path.exists(tmp_path / "persistent" / "step_6")
    assert json.loads(manifest.read_bytes().rsplit(b',"manifest_crc32c"', 1)[0] + b"}")["process_count"] == 4


def test_a_host_killed_during_a_local_save_leaves_the_previous_step(tmp_path):
    killed = process_group.run("tiers.tier_scenarios.killed_during_a_local_save", 4, str(tmp_path), "kill")
    assert killed[1].returncode == -9, killed[1].output[-3000:]
    for i in (0, 2, 3):  # each hears of it from us, unless JAX's own heartbeat ends it first
        assert killed[i].result is None or killed[i].result["error"], killed[i].output[-3000:]
    resumed = results_of(
        process_group.run("tiers.tier_scenarios.killed_during_a_local_save", 4, str(tmp_path), "resume")
    )
    for res in resumed:
        assert res["latest"] == 2 and res["step"] == 2 and res["mismatches"] == [], res
        assert res["persistent_opened"] == [], res
        assert res["after"] == ["step_2", "step_3"], res  # the next save removed any leftover
    assert [n for n in resumed[1]["before"] if not n.startswith("step_3.tmp-")] == ["step_1", "step_2"], resumed[1]
    assert len(resumed[1]["before"]) == 3, resumed[1]  # the killed process's part of step 3, never committed


def test_a_local_directory_shared_by_the_processes_is_refused(tmp_path):
    for res in results_of(process_group.run("tiers.tier_scenarios.shared_local_directory", 2, str(tmp_path))):
        assert res["error"] == "CheckpointError" and "is shared with other processes" in res["message"], res
    assert sorted(os.listdir(tmp_path / "local")) == []  # nothing committed, nothing left


def test_a_local_step_restores_onto_another_process_count(tmp_path):
    saved = results_of(process_group.run("tiers.tier_scenarios.another_process_count", 4, str(tmp_path), "save"))
    assert [f for f in saved[0]["local"]["step_2"] if f.startswith("index-")] == [
        "index-00000.bin", "index-00002.bin", "index-00003.bin"]
    for res in results_of(process_group.run("tiers.tier_scenarios.another_process_count", 2, str(tmp_path), "restore")):
        assert res["step"] == 2 and res["mismatches"] == [] and res["persistent_opened"] == [], res


@pytest.mark.parametrize("fanout", ["", "1"], ids=["flat", "tree"])
def test_a_damaged_part_fails_the_restore_on_every_process(tmp_path, fanout):
    """The holder of the damaged part finds it (each holder checks its own parts' indexes);
    the other process hears of it, named; the same where the merge goes through the tree
    (a fan-out of 1: each process is its own group)."""
    other, holder = results_of(process_group.run("tiers.tier_scenarios.damaged_index", 2, str(tmp_path), fanout))
    assert holder["error"] == "CorruptCheckpointError" and "index-00001.bin" in holder["message"], holder
    assert other["error"] == "RemoteProcessError" and "index-00001.bin" in other["message"], other


def test_the_tier_merge_is_spread_over_the_processes_none_reads_another_part_s_index(tmp_path):
    """Issue 24: no process-0 funnel. Each part's holder cuts its own index by range of leaves;
    process r reads range r's rows of every part (6 leaves, 4 processes: 4 ranges) and no
    process reads any part's whole index."""
    results = results_of(process_group.run("tiers.tier_scenarios.spread_merge", 4, str(tmp_path)))
    for me, res in enumerate(results):
        assert res["step"] == 2 and res["mismatches"] == [], res
        assert not [n for n in res["names"] if n.startswith("index-")], res["names"]
        rows = [f"rows-{o:05d}-{me:05d}.bin" for o in range(4)]
        assert [n for n in res["names"] if n.startswith("rows-")] == rows, res


def test_async_local_saves_keep_host_memory_limit_on_every_process(tmp_path):
    scenario = "tiers.tier_scenarios.async_local_saves_under_a_memory_limit"
    for res in results_of(process_group.run(scenario, 2, str(tmp_path))):
        assert res == {"local": [], "persistent": []}, res


def test_a_damaged_local_data_file_falls_back_to_the_persistent_step(tmp_path):
    for res in results_of(process_group.run("tiers.tier_scenarios.damaged_data_falls_back", 2, str(tmp_path))):
        assert res == {"step": 1, "mismatches": []}, res


@pytest.mark.parametrize(("case", "cause"), [
    ("timeout", "CoordinationTimeoutError"), ("holder", "Relay"), ("error", "process 1: OSError: the disk went away")])
def test_a_tier_restore_failing_anywhere_falls_back_to_the_persistent_step_on_every_process(tmp_path, case, cause):
    for res in results_of(process_group.run("tiers.tier_fallback_scenarios.restore_fails", 4, str(tmp_path), case)):
        assert res["step"] == 1 and res["mismatches"] == [], res
        assert len(res["warnings"]) == 1 and cause in res["warnings"][0], res
        assert res["again"] == 3 and res["again_mismatches"] == [], res  # the next restore is the local one again


def test_a_whole_slice_lost_restores_from_the_other_slice_with_nothing_sent_at_save_time(tmp_path, monkeypatch):
    monkeypatch.setenv("TPU_CKPT_SLICES", "0,0,1,1")
    results = results_of(process_group.run("tiers.tier_slice_scenarios.whole_slice_lost", 4, str(tmp_path)))
    for me, res in enumerate(results):
        assert res["sent_per_step"] == 0, res  # each slice's own copy is the replica
        assert res["copy"] == ([0, 1] if me < 2 else [2, 3]), res
        assert [n for n in res["local"] if n.startswith("index-")] == [f"index-{me:05d}.bin"], res
        assert res["persistent_1"] == [], res  # slice 0's copy was uploaded, once
        assert res["step"] == 3 and res["mismatches"] == [] and res["persistent_opened"] == [], res
        assert res["host_mismatches"] == [], res


def test_replicas_inside_a_single_slice_are_warned_of_and_none_are_accepted(tmp_path):
    for res in results_of(process_group.run("tiers.tier_slice_scenarios.one_slice_warns", 2, str(tmp_path))):
        assert len(res["1"]) == 1 and "local_replicas=1" in res["1"][0], res
        assert len(res["0"]) == 1, res  # no second warning for local_replicas=0


def test_each_slice_restores_its_own_copy_and_only_a_wiped_slice_is_filled(tmp_path, monkeypatch):
    monkeypatch.setenv("TPU_CKPT_SLICES", "0,0,1,1")
    results = results_of(process_group.run("tiers.tier_slice_scenarios.every_slice_own_copy", 4, str(tmp_path)))
    for res in results:
        for case in ("intact", "slice_1_wiped"):
            assert res[case]["step"] == 3 and res[case]["mismatches"] == [], res
        # Every slice reads its own copy, and the leaf replicated on every device (one part of each
        # slice's copy holds it) is completed inside each slice by a collective: no data byte over the relay.
        assert res["intact"]["data"] == 0, res
        # The lost slice is filled from slice 0's copy by one collective over the mesh's slice axis
        # (restoring/_fanout.py): right values, and no data byte over the relay.
        assert res["slice_1_wiped"]["data"] == 0, res
    print({me: res for me, res in enumerate(results)})


def test_no_replica_lands_on_its_owners_host_with_two_processes_per_host(tmp_path, monkeypatch):
    monkeypatch.setenv("TPU_CKPT_HOSTS", "0,0,1,1")  # 2 processes per simulated host
    results = results_of(process_group.run("tiers.tier_slice_scenarios.host_lost_with_two_processes", 4, str(tmp_path)))
    for me, res in enumerate(results):
        other_host = (me + 2) % 4  # a host's k-th process keeps the other host's k-th's part
        assert res["indexes"] == sorted([f"index-{me:05d}.bin", f"index-{other_host:05d}.bin"]), res
        assert res["step"] == 2 and res["mismatches"] == [], res  # host 0 lost whole: step 2 still local
