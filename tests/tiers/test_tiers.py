"""Multi-tier CheckpointManager in one process: cadence, retention, the choice between tiers,
refused arguments and a damaged local file (4 processes: test_multitier.py)."""

import json
import os

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.tiers._choice import Choice, decide
from tpu_ckpt.tiers._replicas import replica_roles


def tree(step: int) -> dict:
    return {"w": np.full((8, 4), step, np.float32), "step": step}


def manager(tmp_path, **kwargs) -> tc.CheckpointManager:
    args = dict(save_interval_steps=3, local_directory=str(tmp_path / "local"), local_interval_steps=2,
                local_max_to_keep=2)
    return tc.CheckpointManager(str(tmp_path / "persistent"), **{**args, **kwargs})


def test_either_tier_due_saves_locally_and_persistent_steps_are_uploaded(tmp_path):
    with manager(tmp_path) as m:
        saved = [step for step in range(1, 7) if m.save(step, tree(step))]
    # Local every 2 steps, persistent every 3 (TF's rule: counted from the last save of each).
    assert saved == [1, 3, 4, 6]
    assert m.all_steps() == [1, 4]
    assert sorted(os.listdir(tmp_path / "local")) == ["step_4", "step_6"]
    assert tc.restore(str(tmp_path / "persistent" / "step_4"))["step"] == 4
    with manager(tmp_path) as m:
        assert m.latest_step() == 6
        assert m.restore()["step"] == 6
        assert m.restore(4)["step"] == 4  # on both tiers: the local copy
        assert not m.save(5, tree(5))  # the restore counts as the last save, for both cadences
        assert m.save(6, tree(60))  # saved again: the old local step 6 is replaced, never mixed in
        np.testing.assert_array_equal(m.restore(6)["w"], tree(60)["w"])
    assert sorted(os.listdir(tmp_path / "local")) == ["step_4", "step_6"]


def _damage(tmp_path, step: int) -> None:
    data = tmp_path / "local" / f"step_{step}" / "d00000-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))


def test_a_damaged_local_step_falls_back_to_the_persistent_tier(tmp_path, caplog):
    with manager(tmp_path) as m:
        m.save(1, tree(1))  # local and persistent
        m.save(3, tree(3))  # local only
    _damage(tmp_path, 3)
    with manager(tmp_path) as m:
        restored = m.restore()
    assert restored["step"] == 1
    np.testing.assert_array_equal(restored["w"], tree(1)["w"])
    assert "the local step 3 from" in caplog.text and "d00000-00000.safetensors" in caplog.text


def test_a_damaged_local_file_is_named_when_nothing_persistent_can_replace_it(tmp_path):
    with manager(tmp_path) as m:
        m.save(1, tree(1))
        m.save(3, tree(3))
    _damage(tmp_path, 3)
    with pytest.raises(tc.CorruptCheckpointError) as error, manager(tmp_path) as m:
        m.restore(3)  # the persistent tier has no step 3
    assert error.value.key == "w" and error.value.file.endswith("d00000-00000.safetensors")


def test_leftovers_of_interrupted_local_saves_are_removed(tmp_path):
    leftover = tmp_path / "local" / "step_9.tmp-0123abcd"
    leftover.mkdir(parents=True)
    (leftover / "d00000-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "local" / "notes").mkdir()
    with manager(tmp_path) as m:
        assert m.latest_step() is None
        m.save(1, tree(1))
    assert sorted(os.listdir(tmp_path / "local")) == ["notes", "step_1"]


def _report(*steps: tuple) -> str:
    return json.dumps([[step, token, count, owners] for step, token, count, owners in steps])


def test_the_newest_step_whole_on_the_live_hosts_is_chosen():
    reports = {
        0: _report((7, "a", 3, [0, 2]), (8, "b", 3, [0, 2])),
        1: _report((7, "a", 3, [1, 0])),
        2: _report((8, "b", 3, [2])),  # step 8: process 1's part is on no live host
    }
    assert decide(reports, {5}, None) == Choice(7, True, {0: 0, 1: 1, 2: 0})
    assert decide(reports, {5, 9}, None) == Choice(9)  # the persistent tier is newer
    assert decide(reports, {5}, 8) == Choice(None) and decide(reports, {5}, 5) == Choice(5)
    two_saves = {0: _report((7, "a", 2, [0])), 1: _report((7, "z", 2, [1]))}  # never mixed
    assert decide(two_saves, set(), None) == Choice(None)
    replaced = {0: _report((7, "a", 2, [0, 1])), 1: _report()}  # host 1 has an empty disk
    assert decide(replaced, set(), None) == Choice(7, True, {0: 0, 1: 0})


def _holders_of_every_process(replicas: int, slices: tuple) -> dict[int, list[int]]:
    """The rule, stated for every owner at once (O(N^2 log N)): the next processes by index,
    those of another slice first."""
    count = len(slices)
    holders = {}
    for owner in range(count):
        others = sorted(((owner + k) % count for k in range(1, count)), key=lambda p: (
            slices[p] is not None and slices[p] == slices[owner], (p - owner) % count))
        holders[owner] = others[: min(replicas, count - 1)]
    return holders


def test_replicas_go_to_the_next_processes():
    assert replica_roles(0, 1, (None,) * 4) == ((1,), frozenset({3}))
    assert replica_roles(1, 5, (None,) * 3) == ((2, 0), frozenset({0, 2}))
    assert replica_roles(0, 1, (None,)) == ((), frozenset())
    assert replica_roles(0, 1, (0, 0, 1, 1)) == ((2,), frozenset({2, 3}))  # another slice first


@pytest.mark.parametrize("seed", range(6))
def test_each_process_works_out_its_own_replicas_as_the_whole_rule_says(seed):
    """Every process computes only whom it sends to and whose parts it keeps; both agree with
    the rule worked out for every process, for slices of any size and unknown slices."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 24))
    slices = tuple(None if rng.random() < 0.2 else int(s) for s in rng.integers(0, 4, count))
    replicas = int(rng.integers(1, 4))
    holders = _holders_of_every_process(replicas, slices)
    for me in range(count):
        sends, keeps = replica_roles(me, replicas, slices)
        assert list(sends) == holders[me], (me, slices)
        assert keeps == {owner for owner, held_by in holders.items() if me in held_by}, (me, slices)


@pytest.mark.parametrize("arg, message", [
    (dict(local_directory="gs://bucket/local"), "own disk"),
    (dict(local_replicas=-1), "local_replicas"),
    (dict(local_max_to_keep=0), "local_max_to_keep"),
    (dict(local_interval_steps=0), "local_interval_steps"),
    (dict(options=tc.CheckpointOptions(io_device=0)), "io_device"),
])
def test_bad_arguments_are_refused(tmp_path, arg, message):
    with pytest.raises(ValueError, match=message):
        manager(tmp_path, **arg)
