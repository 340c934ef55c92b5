"""The local tier's choice among damaged, duplicate and foreign local steps: each test shows
one bug found in review, now fixed."""

import json
import shutil

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.tiers._choice import decide
from tpu_ckpt.tiers._local_steps import held_steps


def tiered(tmp_path) -> tc.CheckpointManager:
    return tc.CheckpointManager(
        str(tmp_path / "persistent"), save_interval_steps=3, local_directory=str(tmp_path / "local"),
        local_interval_steps=2,
    )


@pytest.mark.parametrize("count", [10**12, 0, -1, 1.5, True])
def test_a_damaged_process_count_in_tier_json_is_skipped(tmp_path, count):
    # A count of 10**12 made process 0 build a set of 10**12 ints (a raw MemoryError or the
    # OOM killer, while every other process waits); 0 or -1 made the step "whole" with no part.
    with tiered(tmp_path) as m:
        m.save(1, {"w": np.full((8, 4), 1, np.float32)})
        m.save(3, {"w": np.full((8, 4), 3, np.float32)})
    tier_json = tmp_path / "local" / "step_3" / "tier.json"
    tier_json.write_text(json.dumps({**json.loads(tier_json.read_text()), "count": count}))
    with tiered(tmp_path) as m:
        assert m.latest_step() == 1  # the persistent step: the damaged local step is skipped
        assert m.restore()["w"][0, 0] == 1


def held(root) -> str:
    """What a process reports of its local steps at a restore (tier_restore.choose)."""
    return json.dumps([[s.step, s.token, s.count, list(s.owners)] for s in held_steps(str(root))])


def test_of_two_whole_saves_of_one_step_the_newer_is_chosen(tmp_path):
    # Step 3 is saved, the job rolls back to step 1 and saves step 3 again. A host killed
    # after that save's barrier but before its rename (README: survived) still holds the
    # first save of step 3, whole with 2 processes and local_replicas=1. The choice was the
    # larger random token: the abandoned trajectory's state half of the time. Here the old
    # save's token is made the larger one (a few re-saves at most), as it is half the time.
    with tiered(tmp_path) as m:
        m.save(1, {"w": np.full((8, 4), 1, np.float32)})
        m.save(3, {"w": np.full((8, 4), 3, np.float32)})
    stale = tmp_path / "stale_host"
    shutil.copytree(tmp_path / "local" / "step_3", stale / "step_3")
    (old,) = [s.token for s in held_steps(str(stale))]
    for _ in range(20):
        with tiered(tmp_path) as m:
            m.restore(1)
            assert m.save(3, {"w": np.full((8, 4), 30, np.float32)})
        new = [s.token for s in held_steps(str(tmp_path / "local")) if s.step == 3][0]
        if old > new:
            break
    choice = decide({0: held(tmp_path / "local"), 1: held(stale)}, set(), None)
    assert choice.step == 3 and choice.holders == {0: 0}  # process 0 holds the newer save


@pytest.mark.parametrize(
    "other", [{"w": np.ones((4, 4), np.float32), "v": np.ones(3)}, {"w": np.ones((16, 4), np.float32)}]
)
def test_a_local_steps_plan_from_another_save_is_named_as_corrupt(tmp_path, other):
    # plan.json and the parts' indexes, each intact (crc-sealed) but of different saves (a
    # host's disk restored from an old image, a hand copy): a raw IndexError from the tiling
    # check for a leaf no index has a piece of, or "refusing to commit" naming no file.
    with tiered(tmp_path / "a") as m:
        m.save(1, {"w": np.full((8, 4), 1, np.float32)})
    with tiered(tmp_path / "b") as m:
        m.save(1, other)
    shutil.copy(tmp_path / "b" / "local" / "step_1" / "plan.json", tmp_path / "a" / "local" / "step_1" / "plan.json")
    shutil.rmtree(tmp_path / "a" / "persistent" / "step_1")  # else the restore falls back to it
    with pytest.raises(tc.CorruptCheckpointError) as error, tiered(tmp_path / "a") as m:
        m.restore()
    assert error.value.file == str(tmp_path / "a" / "local" / "step_1"), error.value
    assert "commit" not in str(error.value), error.value
