"""Bounds and local steps: an upload within object_bytes, an async save within
host_memory_limit, and the local tier's choice among damaged, duplicate and foreign steps;
each test shows one bug found in review, now fixed."""

import json
import shutil
import uuid

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import storage, tiers
from tpu_ckpt.saving import _data_writes as data_writes
from tpu_ckpt.tiers import decide

MIB = 1 << 20


def spare_bytes() -> int:
    """The bytes of the snapshot buffers kept for the next async save (emptied)."""
    return sum(a.nbytes for arrays in data_writes._SPARES.take_all().values() for a in arrays)


def test_an_upload_to_an_object_store_keeps_its_objects_within_object_bytes(tmp_path, knobs):
    # tc.save to memory:// cuts data files at object_bytes; the local tier planned its files
    # without that bound, so the upload put one object bigger than object_bytes.
    knobs(object_bytes=12_000)
    url = f"memory://tiers-{uuid.uuid4().hex[:8]}/run"
    state = {"big": np.arange(96 * 70, dtype=np.float32).reshape(96, 70)}  # 26,880 B
    with tc.CheckpointManager(url, save_interval_steps=1, local_directory=str(tmp_path / "local")) as m:
        m.save(1, state)
    with storage.Store(storage.location(f"{url}/step_1")) as store:
        objects = {n: len(store.read_file(n)) for n in store.list() if n.endswith(".safetensors")}
    assert objects and max(objects.values()) <= 12_000, objects
    np.testing.assert_array_equal(tc.restore(f"{url}/step_1")["big"], state["big"])


def test_an_async_local_save_holds_at_most_host_memory_limit(tmp_path):
    # README: under host_memory_limit an async save's snapshot (and the recycled buffers
    # kept after it) is at most N. The local tier copied the whole state regardless.
    limit = 16 * MIB
    state = {f"w{i}": np.full((3 * MIB,), i, np.float32) for i in range(4)}  # 48 MiB
    options = tc.CheckpointOptions(enable_async=True, host_memory_limit=limit)
    spare_bytes()
    tc.save(str(tmp_path / "plain"), state, options=options).wait()
    assert spare_bytes() <= limit  # an ordinary async save keeps the bound
    with tc.CheckpointManager(str(tmp_path / "persistent"), save_interval_steps=100, options=options,
                              local_directory=str(tmp_path / "local")) as m:
        m.save(1, state)
        m.save(2, state)
    held = spare_bytes()
    assert held <= limit, f"{held / MIB:.0f} MiB of snapshot buffers kept, over the {limit / MIB:.0f} MiB limit"
    with tc.CheckpointManager(str(tmp_path / "persistent"), local_directory=str(tmp_path / "local")) as m:
        np.testing.assert_array_equal(m.restore(2)["w3"], state["w3"])


def tiered(tmp_path) -> tc.CheckpointManager:
    return tc.CheckpointManager(
        str(tmp_path / "persistent"), save_interval_steps=3, local_directory=str(tmp_path / "local"), local_interval_steps=2
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
    return json.dumps([[s.step, s.token, s.count, list(s.owners)] for s in tiers.held_steps(str(root))])


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
    (old,) = [s.token for s in tiers.held_steps(str(stale))]
    for _ in range(20):
        with tiered(tmp_path) as m:
            m.restore(1)
            assert m.save(3, {"w": np.full((8, 4), 30, np.float32)})
        new = [s.token for s in tiers.held_steps(str(tmp_path / "local")) if s.step == 3][0]
        if old > new:
            break
    choice = decide({0: held(tmp_path / "local"), 1: held(stale)}, set(), None)
    assert choice.step == 3 and choice.holders == {0: 0}  # process 0 holds the newer save


@pytest.mark.parametrize("other", [{"w": np.ones((4, 4), np.float32), "v": np.ones(3)}, {"w": np.ones((16, 4), np.float32)}])
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


def test_a_commit_of_a_leaf_no_process_wrote_is_refused_with_a_checkpoint_error():
    from tests.helpers import binary_merge
    from tpu_ckpt.saving import plan_save

    plan = plan_save({"w": np.ones((8, 4), np.float32)}, tc.CheckpointOptions(), process_index=0, process_count=1)
    with pytest.raises(tc.CheckpointError, match="'w'.*leaving a gap"):
        binary_merge(plan.manifest, [])  # every index lacks the leaf (processes saving different trees)
