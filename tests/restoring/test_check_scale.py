"""check_restore counts a pod's pieces by layout (restoring/_check_reads.py): its report over
many leaves of one layout is what the restore's own per-piece plan and a real restore read."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.restoring.counting_reads import restore_counting_reads
from tests.support.helpers import manifest, write_manifest
from tpu_ckpt import format as fmt
from tpu_ckpt import settings
from tpu_ckpt.restoring._check_reads import _requests
from tpu_ckpt.restoring._plan import ArrayRead

LEAVES = 12


@pytest.fixture
def many(tmp_path, mesh42):
    """12 leaves of one layout (16, 8) on the (4, 2) mesh, 4 of another (8,) on "data", a
    scalar and a numpy leaf: leaves of one layout share their plan, the others their own."""
    path = str(tmp_path / "many")
    rows_cols = NamedSharding(mesh42, P("data", "model"))
    state = {
        f"w{i:02d}": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + i, rows_cols)
        for i in range(LEAVES)
    }
    rows = NamedSharding(mesh42, P("data"))
    state.update({f"b{i}": jax.device_put(np.arange(8, dtype=np.int32) + i, rows) for i in range(4)})
    state.update(step=jax.device_put(np.float32(3), NamedSharding(mesh42, P())), host=np.arange(6, dtype=np.int64))
    tc.save(path, state).wait()
    return path


def _target(mesh, spec):
    out = {
        f"w{i:02d}": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, spec))
        for i in range(LEAVES)
    }
    out.update(
        {f"b{i}": jax.ShapeDtypeStruct((8,), np.int32, sharding=NamedSharding(mesh, P(spec[0]))) for i in range(4)}
    )
    out.update(step=jax.ShapeDtypeStruct((), np.float32, sharding=NamedSharding(mesh, P())), host=np.zeros(6, np.int64))
    return out


def _per_piece_leaves(plan):
    """Per key: the bytes its units read, those beyond its regions, and whether a region is
    not exactly one saved piece, worked out piece by piece from the plan."""
    read, wanted = {}, {}
    for unit in (u for batch in plan.batches for u in batch):
        key, itemsize = unit.array.key, np.dtype(unit.array.leaf.dtype).itemsize
        read[key] = read.get(key, 0) + sum(p.length for p in unit.pieces)
        wanted[key] = wanted.get(key, 0) + sum(int(np.prod(fmt.extent(r.slice))) * itemsize for r in unit.regions)
    return {
        e.key: (read[e.key], read[e.key] - wanted[e.key],
                any(len(r.pieces) != 1 or (r.slice and r.pieces[0].slice != r.slice) for r in e.regions))
        for e in plan.leaves if isinstance(e, ArrayRead)
    }


@pytest.mark.parametrize("batch", [256 << 20, 64], ids=["one batch", "a unit per region"])
@pytest.mark.parametrize("layout", ["as saved", "columns cut", "reversed devices"])
def test_many_leaves_of_one_layout_report_what_the_restore_reads(many, mesh42, mesh24, batch, layout):
    reversed_devices = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    mesh = {"as saved": mesh42, "columns cut": mesh24, "reversed devices": reversed_devices}[layout]
    target = _target(mesh, P("data", "model"))
    previous = settings.configure(settings.Settings(read_batch_bytes=batch))
    try:
        report = tc.check_restore(many, target)
        plan, measured = restore_counting_reads(many, target)
    finally:
        settings.configure(previous)
    assert report.ok and (report.bytes_per_process[0], report.requests_per_process[0]) == measured
    assert {x.key: (x.read_bytes, x.over_read, x.resharded) for x in report.leaves} == _per_piece_leaves(plan)
    assert report.over_read_per_process[0] == sum(x.over_read for x in report.leaves)
    # devices alone: as saved
    assert len(report.leaves) == LEAVES + 6 and (layout == "columns cut") == bool(report.resharded)


def test_processes_share_one_layout_plan_and_each_reads_its_rows(many, mesh24):
    """Two hosts of four devices: host 0 takes mesh24's first row. Each w leaf's rows 0-7
    (host 0) are pieces 0-3 of the saved 4x2 grid: half of every leaf, each piece once."""
    target = _target(mesh24, P("data", "model"))
    report = tc.check_restore(many, target, devices_per_process=4)
    one_host = tc.check_restore(many, target, devices_per_process=8)
    assert one_host.reads == tc.check_restore(many, target).reads
    w_bytes = LEAVES * 128 * 4
    assert report.bytes_per_process[0] == report.bytes_per_process[1] >= w_bytes // 2
    # scalar, host leaf: both hosts
    assert sum(report.bytes_per_process.values()) - one_host.bytes_per_process[0] == 4 + 6 * 8
    assert report.over_read_per_process == {0: 0, 1: 0}


def test_a_sharding_is_asked_for_its_devices_once_per_shape_not_once_per_leaf(many, mesh24, monkeypatch):
    calls = []
    for name in ("devices_indices_map", "addressable_devices_indices_map"):
        real = getattr(NamedSharding, name)
        monkeypatch.setattr(
            NamedSharding, name, lambda self, shape, real=real: calls.append(shape) or real(self, shape)
        )
    report = tc.check_restore(many, _target(mesh24, P("data", "model")))
    assert report.ok and len(report.leaves) == LEAVES + 6
    assert len(calls) <= 2 * 3  # three shapes (w, b, step), each map at most twice, for 17 sharded leaves


@pytest.mark.parametrize("seed", range(4))
def test_requests_are_those_coalesce_makes(seed):
    """Runs of pieces back to back, padded, apart, in several files, some past MAX_READ_BYTES."""
    rng = np.random.default_rng(seed)
    pieces, at = [], {}
    for _ in range(300):
        file = f"d{rng.integers(3)}"
        gap = int(rng.choice([0, 1, fmt.ALIGNMENT - 1, fmt.ALIGNMENT, 5000], p=[0.9, 0.025, 0.025, 0.025, 0.025]))
        length = int(rng.choice([16, 4096, 3 << 20, 9 << 20]))
        offset = at.get(file, 0) + gap
        pieces.append(fmt.PieceEntry((), file, offset, length, 0))
        at[file] = offset + length
    expected = fmt.coalesce(("k", p) for p in pieces)
    ordered = sorted(pieces, key=lambda p: (p.file, p.offset))
    columns = [np.array(c, dtype=np.int64) for c in zip(*((int(p.file[1:]), p.offset, p.length) for p in ordered))]
    assert _requests(*columns) == len(expected) > len({p.file for p in pieces})
    assert any(r.stop - r.start > fmt.MAX_READ_BYTES - (9 << 20) for r in expected)  # the 64 MiB cap is reached


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda rows, doc: rows["file"].__setitem__(3, len(doc["files"])), "file index"),
        (lambda rows, doc: rows["offset"].__setitem__(3, 1 << 62), "offset"),
        (
            lambda rows, doc: (
                rows["offset"].__setitem__(3, rows["offset"][2]), rows["file"].__setitem__(3, rows["file"][2])
            ),
            "overlapping",
        ),
    ],
    ids=["file_index", "offset_past_file", "two_rows_same_bytes"],
)
def test_rows_checked_many_leaves_at_once_name_the_bad_leaf_as_alone(many, mesh42, edit, fragment):
    """The rows of a whole tree are checked in one pass (format/_table_rows.whole_columns);
    a bad row in one leaf is the error a restore of that leaf alone raises."""
    doc = manifest(many)
    entry = next(e for e in doc["leaves"] if e["key"] == "w05")
    t, row, count, _ = entry["table"]
    table = os.path.join(many, doc["tables"][t][0])
    data = bytearray(open(table, "rb").read())
    rows = np.frombuffer(bytes(data[16 * row : 16 * (row + count)]), fmt.ROW).copy()
    edit(rows, doc)
    data[16 * row : 16 * (row + count)] = rows.tobytes()
    open(table, "wb").write(bytes(data))
    entry["table"][3] = fmt.crc32c(rows.tobytes())  # resealed: what is tested is the row check
    write_manifest(many, doc)
    with pytest.raises(tc.CorruptCheckpointError) as alone:
        tc.restore(many, {"w05": _target(mesh42, P("data", "model"))["w05"]})
    for whole_tree in (lambda: tc.restore(many, _target(mesh42, P("data", "model"))), lambda: tc.check_restore(many)):
        with pytest.raises(tc.CorruptCheckpointError) as together:
            whole_tree()
        assert str(together.value) == str(alone.value) and fragment in str(alone.value) and together.value.key == "w05"
    assert tc.restore(many, {"w04": _target(mesh42, P("data", "model"))["w04"]})["w04"].shape == (16, 8)
