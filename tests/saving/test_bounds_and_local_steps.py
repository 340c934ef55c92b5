"""Bounds and local steps: an upload within object_bytes, an async save within
host_memory_limit; each test shows one bug found in review, now fixed (the local tier's choice
among damaged, duplicate and foreign steps: tests/tiers/test_local_step_choice.py)."""

import uuid

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import storage
from tpu_ckpt.saving import _data_writes as data_writes

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


def test_a_commit_of_a_leaf_no_process_wrote_is_refused_with_a_checkpoint_error():
    from tests.support.helpers import binary_merge
    from tpu_ckpt.saving import plan_save

    plan = plan_save({"w": np.ones((8, 4), np.float32)}, tc.CheckpointOptions(), process_index=0, process_count=1)
    with pytest.raises(tc.CheckpointError, match="'w'.*leaving a gap"):
        binary_merge(plan.manifest, [])  # every index lacks the leaf (processes saving different trees)
