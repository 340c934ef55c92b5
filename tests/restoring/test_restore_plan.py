"""Restore planning with no files: manifests are built in memory, as DCP tests its planners."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tpu_ckpt.format import LeafEntry, Manifest, PieceEntry
from tpu_ckpt.restoring._plan import ArrayRead, NoRead, plan_restore

plan_restore = functools.partial(plan_restore, batch_bytes=1 << 20)


def array_leaf(key, shape, rows=1, cols=1, dtype="float32", is_slot=False):
    """A scalar or 2-D leaf saved as a rows x cols grid of pieces, piece i in file ``d<i>`` at offset 64."""
    pieces = []
    itemsize = np.dtype(dtype).itemsize
    if not shape:
        pieces.append(PieceEntry((), "d0", 64, itemsize, 0))
    for r in range(rows if shape else 0):
        for c in range(cols):
            h, w = shape[0] // rows, shape[1] // cols
            spec = ((r * h, (r + 1) * h), (c * w, (c + 1) * w))
            pieces.append(PieceEntry(spec, f"d{len(pieces)}", 64, h * w * itemsize, 0))
    path = [("dict", name) for name in key.split("/")]
    return LeafEntry(key, path, "array", tuple(shape), dtype, is_slot, None, tuple(pieces))


def value_leaf(key, value):
    return LeafEntry(key, [("dict", name) for name in key.split("/")], "value", value=value)


def manifest(*leaves):
    return Manifest(tuple(leaves), {}, 1, "test")


def region_reads(entry):
    return {region.slice: sorted(p.slice for p in region.pieces) for region in entry.regions}


def test_resharding_from_a_4x2_to_a_2x4_mesh_reads_the_overlapping_pieces(mesh24):
    saved = manifest(array_leaf("w", (8, 8), rows=4, cols=2))  # pieces of 2 rows x 4 columns
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh24, P("data", "model")))}
    (entry,) = plan_restore(saved, target).leaves
    reads = region_reads(entry)
    assert len(reads) == 8  # one region per device: 4 rows x 2 columns
    assert reads[((0, 4), (0, 2))] == [((0, 2), (0, 4)), ((2, 4), (0, 4))]
    assert reads[((4, 8), (6, 8))] == [((4, 6), (4, 8)), ((6, 8), (4, 8))]
    for region in entry.regions:
        (device,) = region.devices
        index = target["w"].sharding.devices_indices_map((8, 8))[device]
        assert region.slice == tuple((s.start, s.stop) for s in index)


def test_a_replicated_target_reads_each_region_once(mesh42):
    saved = manifest(array_leaf("w", (8, 8), rows=4, cols=2))
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh42, P()))}
    plan = plan_restore(saved, target)
    ((region,),) = [entry.regions for entry in plan.leaves]
    assert len(region.devices) == 8 and len(region.pieces) == 8
    ((unit,),) = plan.batches
    assert len(unit.pieces) == 8


def test_a_target_sharded_on_one_axis_shares_regions_between_devices(mesh24):
    saved = manifest(array_leaf("w", (8, 8), rows=4, cols=2))
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh24, P("data")))}
    (entry,) = plan_restore(saved, target).leaves
    assert [(r.slice, len(r.devices), len(r.pieces)) for r in entry.regions] == [
        (((0, 4), (0, 8)), 4, 4), (((4, 8), (0, 8)), 4, 4),
    ]


def test_a_subtree_plans_only_its_leaves_and_rebuilds_below_it():
    saved = manifest(array_leaf("params/w", (4, 4)), value_leaf("params/n", 3), array_leaf("opt/mu/w", (4, 4)))
    plan = plan_restore(saved, None, "params")
    assert [e.key for e in plan.leaves] == ["params/w", "params/n"]
    assert plan.tree(["W", 3]) == {"w": "W", "n": 3}
    target_plan = plan_restore(saved, {"w": np.zeros((4, 4), np.float32)}, "/params/")
    assert [e.key for e in target_plan.leaves] == ["params/w"]
    with pytest.raises(tc.TargetMismatchError, match=r"subtree 'opt/nu' is not in checkpoint <manifest>.*'opt'"):
        plan_restore(saved, None, "opt/nu")


def test_skipped_slots_are_not_read():
    saved = manifest(array_leaf("w", (4, 4)), array_leaf("mu/w", (4, 4), is_slot=True))
    kept = object()
    plan = plan_restore(saved, {"w": np.zeros((4, 4), np.float32), "mu": {"w": kept}}, skip_slots=True)
    mu, w = plan.leaves  # tree-flatten order: "mu" < "w"
    assert isinstance(mu, NoRead) and mu.skipped_slot and mu.value is kept
    assert [u.array.key for batch in plan.batches for u in batch] == ["w"]
    assert [e.key for e in plan_restore(saved, None, skip_slots=True).leaves] == ["w"]  # no target: left out
    assert [e.key for e in plan_restore(saved, None).leaves] == ["w", "mu/w"]


def test_a_numpy_target_is_one_host_region_in_the_target_dtype():
    saved = manifest(array_leaf("w", (4, 4), rows=2, cols=2))
    (entry,) = plan_restore(saved, {"w": np.zeros((4, 4), jnp.bfloat16)}).leaves
    assert entry.sharding is None and entry.dtype == jnp.bfloat16  # float -> float is a cast
    ((region,),) = [entry.regions]
    assert region.slice == ((0, 4), (0, 4)) and region.devices == () and len(region.pieces) == 4


def test_a_python_scalar_target_takes_any_saved_width_of_its_kind():
    saved = manifest(array_leaf("step", (), dtype="uint32"), array_leaf("lr", (), dtype="bfloat16"))
    step, lr = plan_restore(saved, {"step": 0, "lr": 0.0}).leaves[::-1]  # flatten order: lr, step
    assert (step.python_type, step.dtype) == (int, np.uint32)
    assert (lr.python_type, lr.dtype) == (float, jnp.bfloat16)
    assert [r.slice for r in step.regions] == [()] and len(step.regions[0].pieces) == 1
    with pytest.raises(tc.TargetMismatchError, match="'step'.*float64.*float->float"):
        plan_restore(saved, {"step": 0.5, "lr": 0.0})


def test_a_mismatched_target_names_the_key():
    saved = manifest(array_leaf("params/kernel", (4, 4)), array_leaf("i", (2, 2), dtype="int32"))
    checks = [
        ({"params": {"kernel": np.zeros((4, 5), np.float32)}}, "params/kernel", r"shape \(4, 5\).*\(4, 4\)"),
        ({"i": np.zeros((2, 2), np.float32)}, "i", "int32.*float->float"),
        ({"params": {"kernal": np.zeros((4, 4), np.float32)}}, "params/kernal", "similar keys.*params/kernel"),
        ({"params": {"kernel": "abc"}}, "params/kernel", "is a str"),
    ]
    for target, key, message in checks:
        with pytest.raises(tc.TargetMismatchError, match=f"'{key}'.*{message}") as e:
            plan_restore(saved, target, url="gs://b/ckpt")
        assert e.value.key == key


def test_a_leaf_bigger_than_a_batch_is_read_region_by_region(mesh42):
    saved = manifest(array_leaf("big", (8, 8), rows=4, cols=2), array_leaf("small", (2, 2)))
    sharding = NamedSharding(mesh42, P("data", "model"))
    target = {
        "big": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharding),  # 256 bytes, 32 per region
        "small": jax.ShapeDtypeStruct((2, 2), jnp.float32, sharding=NamedSharding(mesh42, P())),  # 16 bytes
    }
    plan = plan_restore(saved, target, batch_bytes=64)
    assert [[(u.array.key, u.whole, len(u.regions)) for u in batch] for batch in plan.batches] == [
        [("big", False, 1)] * 2, [("big", False, 1)] * 2, [("big", False, 1)] * 2, [("big", False, 1)] * 2,
        [("small", True, 1)],
    ]
    assert len(plan_restore(saved, target).batches) == 1  # within a 1 MiB batch: whole leaves


def test_describe_shows_what_comes_back_and_where_from():
    saved = manifest(
        array_leaf("w", (4, 4), rows=2, dtype="float32"), array_leaf("mu", (4, 4), is_slot=True),
        array_leaf("step", (), dtype="int64"), value_leaf("name", "mlp"),
    )
    target = {"w": np.zeros((4, 4), np.float32), "mu": np.zeros((4, 4), np.float32), "step": 0, "name": ""}
    plan = plan_restore(saved, target, skip_slots=True)
    assert repr(plan) == plan.describe() == "\n".join([
        "RestorePlan: 4 leaves, 1 read batches",
        "  mu: left unchanged (skipped slot variable)",
        "  name: saved value 'mlp'",
        "  step: int64[] -> Python int",
        "    [] reads [] at d0:64",
        "  w: float32[4, 4] -> numpy float32",
        "    [0:4,0:4] reads [0:2,0:4] at d0:64, [2:4,0:4] at d1:64",
        "  batch 0 (72 bytes): step, w",
    ])


def test_describe_names_the_target_sharding_and_devices(mesh24):
    saved = manifest(array_leaf("w", (8, 8), rows=4, cols=2))
    sharding = NamedSharding(mesh24, P("data", "model"))
    plan = plan_restore(saved, {"w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16, sharding=sharding)})
    lines = plan.describe().splitlines()
    mesh = dict(mesh24.shape)
    assert lines[1] == f"  w: float32[8, 8] -> bfloat16 jax.Array on NamedSharding(mesh={mesh}, spec=('data', 'model'))"
    indices = sharding.addressable_devices_indices_map((8, 8))
    first = next(d for d, index in indices.items() if index[0].start == index[1].start == 0)
    assert f"    [0:4,0:2] on devices [{first.id}] reads [0:2,0:4] at d0:64, [2:4,0:4] at d2:64" in lines


def test_plans_are_data():
    saved = manifest(array_leaf("w", (4, 4)))
    target = {"w": np.zeros((4, 4), np.float32)}
    assert plan_restore(saved, target) == plan_restore(saved, target)
    assert all(isinstance(e, ArrayRead) for e in plan_restore(saved, target).leaves)
