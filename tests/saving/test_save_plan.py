"""The save plan, tested as DCP tests its planners: plans and merges built and checked with no
files and no coordination (one multi-process test plans with real processes, then saves)."""

import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support import helpers, process_group
from tests.support.helpers import binary_merge
from tpu_ckpt.format import PieceEntry, TableSource, decode_manifest, encode_manifest, written_by
from tpu_ckpt.saving import plan_save
from tpu_ckpt.saving._commit import index


def written(plan):
    """``{file name: [(key, slice), ...]}``: what the plan writes where."""
    return {f.name: [(p.key, p.slice) for p in f.pieces] for f in plan.files}


def leaf(plan, key):
    return next(e for e in plan.manifest.leaves if e.key == key)


def test_a_sharded_array_is_written_one_piece_per_device_each_into_its_own_file(mesh42):
    x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), NamedSharding(mesh42, P("data", "model")))
    plan = plan_save({"w": x}, process_index=0, process_count=1)
    assert plan.piece_count == 8
    assert written(plan) == {
        f"d00000-{n:05d}.safetensors": [("w", ((2 * (n // 2), 2 * (n // 2) + 2), (2 * (n % 2), 2 * (n % 2) + 2)))]
        for n in range(8)
    }
    entry = leaf(plan, "w")
    assert (entry.kind, entry.shape, entry.dtype, entry.is_slot, entry.pieces) == (
        "array", (8, 4), "float32", False, ()
    )
    assert entry.sharding == {
        "type": "NamedSharding", "mesh": {"data": 4, "model": 2}, "spec": ["data", "model"],
        **helpers.axis_types(mesh42),
    }
    assert plan.manifest.files == {} and plan.manifest.process_count == 1
    (piece,) = plan.files[3].pieces
    np.testing.assert_array_equal(np.asarray(piece.data), np.asarray(x)[2:4, 2:4])
    assert piece.nbytes == 16 and plan.nbytes == 128


def test_replicas_are_written_once(mesh42):
    half = jax.device_put(np.ones((8, 4)), NamedSharding(mesh42, P("data")))  # two copies of each block
    full = jax.device_put(np.ones(6), NamedSharding(mesh42, P()))  # eight copies
    plan = plan_save({"half": half, "full": full}, process_index=0, process_count=1)
    pieces = [piece for f in written(plan).values() for piece in f]
    assert sorted(pieces) == [("full", ((0, 6),))] + [("half", ((a, a + 2), (0, 4))) for a in (0, 2, 4, 6)]


def test_numpy_and_python_values(mesh42):
    tree = {"host": np.arange(6.0).reshape(2, 3), "step": 3, "name": "run-1", "flag": True, "nothing": None}
    plan = plan_save(tree, process_index=0, process_count=2)
    assert written(plan) == {"d00000-00000.safetensors": [("host", ((0, 2), (0, 3)))]}
    assert leaf(plan, "host").sharding is None
    assert {e.key: (e.kind, e.value) for e in plan.manifest.leaves if e.kind == "value"} == {
        "step": ("value", 3), "name": ("value", "run-1"), "flag": ("value", True), "nothing": ("value", None),
    }
    # Every process of an SPMD program holds the same host value: process 0 writes it.
    other = plan_save(tree, process_index=1, process_count=2)
    assert other.files == () and other.manifest == plan.manifest


@pytest.mark.parametrize("policy", [tc.ShardByDevicePolicy, tc.ShardByTaskPolicy])
def test_built_in_policies_plan_the_same_files_through_arrange_as_through_their_call(mesh42, policy):
    """A save plans the device and task policies through ``arrange`` (no ShardableTensor, no
    shard dicts); a subclass, which may change ``__call__``, goes through ``__call__`` and
    validation. Both must write the same pieces, from the same buffers, into the same files."""
    tree = {
        "w": jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh42, P("data", "model"))),
        "half": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh42, P("data"))),
        "host": np.arange(6, dtype=np.int16),
        "step": 3,
    }

    class Same(policy):
        pass

    arranged, called = (
        plan_save(tree, tc.CheckpointOptions(sharding_callback=p), process_index=0, process_count=1)
        for p in (policy(), Same())
    )
    assert written(arranged) == written(called)
    assert len(arranged.files) == (9 if policy is tc.ShardByDevicePolicy else 1)
    assert [f.nbytes for f in arranged.files] == [f.nbytes for f in called.files]
    for a, c in zip(arranged.files, called.files):
        assert all(np.shares_memory(np.asarray(x.data), np.asarray(y.data)) for x, y in zip(a.pieces, c.pieces))


def test_leaves_a_checkpoint_cannot_hold_are_refused_while_planning():
    with pytest.raises(TypeError, match="'bad' is a object"):
        plan_save({"bad": object()}, process_index=0, process_count=1)


def test_slots_are_classified_by_the_rule_or_the_callers_predicate():
    tree = {"params": {"w": np.ones(4)}, "opt_state": {"mu": {"w": np.ones(4)}, "count": np.int32(1)}}
    plan = plan_save(tree, process_index=0, process_count=1)
    assert {e.key: e.is_slot for e in plan.manifest.leaves} == {
        "opt_state/count": False, "opt_state/mu/w": True, "params/w": False,
    }
    custom = plan_save(tree, process_index=0, process_count=1, is_slot=lambda key, _: key.startswith("params"))
    assert {e.key for e in custom.manifest.leaves if e.is_slot} == {"params/w"}


def test_a_sharding_callback_decides_the_files_and_is_validated():
    tree = {"a": np.arange(32, dtype=np.float32).reshape(8, 4), "b": np.arange(4, dtype=np.float32)}
    policy = tc.MaxShardSizePolicy(48)
    plan = plan_save(tree, tc.CheckpointOptions(sharding_callback=policy), process_index=0, process_count=1)
    assert plan.manifest.sharding_callback == policy.description
    assert plan.piece_count == 2 and [f.name for f in plan.files] == [f"d00000-{n:05d}.safetensors" for n in range(3)]
    assert all(f.nbytes <= 48 for f in plan.files) and plan.nbytes == 32 * 4 + 4 * 4
    rows = sorted(p.slice for f in plan.files for p in f.pieces if p.key == "a")
    assert rows == [((0, 3), (0, 4)), ((3, 6), (0, 4)), ((6, 8), (0, 4))]

    class DropsEverything(tc.ShardingCallback):
        description = "drops everything"

        def __call__(self, shardable_tensors):
            return []

    with pytest.raises(tc.InvalidShardsError, match="drops everything"):
        plan_save(tree, tc.CheckpointOptions(sharding_callback=DropsEverything()), process_index=0, process_count=1)


def test_a_callback_returning_multi_device_arrays_plans_bounded_files(mesh42):
    """A user's callback may hand back whole jax arrays over several devices (validation
    accepts them); cutting its files to a bound (an object store, host_memory_limit) takes
    them as they are, where only a single CPU device's array becomes a numpy view."""
    replicated = NamedSharding(mesh42, P())

    class OnDevices(tc.ShardingCallback):
        description = "pieces as replicated jax arrays"

        def __call__(self, shardable_tensors):
            shard = {}
            for t in shardable_tensors:
                shard.setdefault(t.checkpoint_key, {})[t.slice_spec] = jax.device_put(np.asarray(t.tensor), replicated)
            return [shard]

    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    tree = {"w": jax.device_put(w, NamedSharding(mesh42, P("data")))}
    options = tc.CheckpointOptions(sharding_callback=OnDevices())
    plan = plan_save(tree, options, process_index=0, process_count=1, max_file_bytes=4096)
    assert len(plan.files) > 2 and plan.nbytes == w.nbytes
    out = np.zeros_like(w)
    for piece in (p for f in plan.files for p in f.pieces):
        out[tuple(slice(a, b) for a, b in piece.slice)] = np.asarray(piece.data)
    np.testing.assert_array_equal(out, w)



def test_describe_lists_the_leaves_the_files_and_the_callback(mesh42):
    tree = {
        "opt_state": {"mu": jax.device_put(np.zeros((4, 2), np.float32), NamedSharding(mesh42, P("data")))},
        "host": np.arange(3, dtype=np.int32),
        "step": 3,
    }
    options = tc.CheckpointOptions(sharding_callback=tc.ShardByTaskPolicy())
    plan = plan_save(tree, options, process_index=0, process_count=1, metrics={"loss": 0.5})
    assert repr(plan) == (
        "SavePlan(process 0 of 1: 3 leaves; writes 5 pieces, 44 bytes, into 1 data file; "
        "sharding_callback='Split tensors into shards based on their device spec task.')"
    )
    assert plan.describe().splitlines()[1:] == [
        "leaves (3):",
        "  host          int32[3]  host value (written by process 0)",
        "  opt_state/mu  float32[4,2]  slot  NamedSharding mesh={'data': 4, 'model': 2} spec=['data']",
        "  step          value 3",
        "data files this process writes (1):",
        "  d00000-00000.safetensors  5 pieces, 44 bytes",
        "    host[0:3]  int32  12 bytes",
        "    opt_state/mu[0:1,0:2]  float32  8 bytes",
        "    opt_state/mu[1:2,0:2]  float32  8 bytes",
        "    opt_state/mu[2:3,0:2]  float32  8 bytes",
        "    opt_state/mu[3:4,0:2]  float32  8 bytes",
        "metrics: {'loss': 0.5}",
    ]


def test_file_names_tell_their_process():
    assert written_by("d00003-00012.safetensors") == 3 and written_by("index-00002.json") == 2
    assert written_by("manifest.json") is None and written_by("d3-1.safetensors") is None


def piece(spec, file):
    return PieceEntry(spec, file, 0, 32, 0)  # a (2, 2) block of float64


def test_merging_indexes_makes_a_new_manifest_and_changes_no_input():
    plan = plan_save({"w": np.ones((4, 2)), "step": 1}, process_index=0, process_count=2)
    own = index({"w": [piece(((2, 4), (0, 2)), "d00000-00000.safetensors")]}, {"d00000-00000.safetensors": 100})
    theirs = index({"w": [piece(((0, 2), (0, 2)), "d00001-00000.safetensors")]}, {"d00001-00000.safetensors": 90})
    before = (plan.manifest, dict(own.files), own.leaves, dict(theirs.files))
    body, tables = encode_manifest(*binary_merge(plan.manifest, [own, theirs]))
    source = TableSource(lambda name, start, length: tables[name][start : start + length], lambda name: name)
    merged = decode_manifest(body, where="the merged manifest", tables=source)
    assert merged.files == {"d00000-00000.safetensors": 100, "d00001-00000.safetensors": 90}
    w = next(e for e in merged.leaves if e.key == "w")
    assert [p.slice for p in w.pieces] == [((0, 2), (0, 2)), ((2, 4), (0, 2))]
    assert (merged.process_count, merged.sharding_callback) == (2, plan.manifest.sharding_callback)
    assert (plan.manifest, dict(own.files), own.leaves, dict(theirs.files)) == before


def test_merging_indexes_that_miss_a_block_refuses_to_commit():
    plan = plan_save({"w": np.ones((4, 2))}, process_index=0, process_count=2)
    own = index({"w": [piece(((2, 4), (0, 2)), "d00000-00000.safetensors")]}, {"d00000-00000.safetensors": 100})
    with pytest.raises(tc.CheckpointError, match="'w'.*refusing to commit"):
        binary_merge(plan.manifest, [own])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_plan_balanced_writes_and_log_only_their_own_files(tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "plan_worker.py")
    runs = process_group.run_script(worker, 2, str(tmp_path))
    assert all(r.returncode == 0 and r.result for r in runs), [r.output for r in runs]
    plans = {r.result["process"]: r.result["files"] for r in runs}
    owner = {}  # (key, slice) -> the process that writes it
    for process, files in plans.items():
        for name, pieces in files.items():
            assert name.startswith(f"d{process:05d}-")
            for key, spec, _ in pieces:
                assert (key, str(spec)) not in owner, (key, spec)  # every block once in the job
                owner[key, str(spec)] = process
    assert sorted(k for k, _ in owner).count("w") == 8 and sorted(k for k, _ in owner).count("replicated") == 1
    assert {p for (k, _), p in owner.items() if k == "host"} == {0}
    assert {p for (k, _), p in owner.items() if k == "big_replicated"} == {0, 1}  # split between its holders
    sizes = [sum(n for pieces in plans[p].values() for *_, n in pieces) for p in (0, 1)]
    assert max(sizes) < 0.55 * sum(sizes), sizes
    # What was committed is what the plans said, and each process logs its own files only.
    saved = helpers.files(tmp_path / "ckpt")
    assert sorted(saved) == sorted(name for files in plans.values() for name in files)
    for process in (0, 1):
        own = {name: size for name, size in saved.items() if name.startswith(f"d{process:05d}-")}
        log = next(r.result["log"] for r in runs if r.result["process"] == process)
        (line,) = [line for line in log if "saved" in line]
        assert re.search(rf"{len(own)} files, {sum(own.values()) / 1e6:.1f} MB from this process", line), line
