"""tc.check_restore: what a restore would do, from the manifest alone, and that tc.restore
raises on exactly the problems it reports."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.restoring.counting_reads import restore_counting_reads
from tests.support.helpers import manifest
from tpu_ckpt import settings

W = np.arange(64, dtype=np.float32).reshape(8, 8)


def sds(shape, dtype, mesh=None, spec=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else NamedSharding(mesh, spec))


@pytest.fixture
def ckpt(tmp_path, mesh42):
    """w (8, 8) float32 saved on the (4, 2) mesh in 2x4 pieces, an int64 vector, a slot, a step."""
    path = str(tmp_path / "ckpt")
    state = {
        "params": {"w": jax.device_put(W, NamedSharding(mesh42, P("data", "model"))), "i": np.arange(4)},
        "opt_state": {"mu": {"w": jax.device_put(W, NamedSharding(mesh42, P("data", "model")))}},
        "step": 7,
    }
    tc.save(path, state).wait()
    return path


ROWS_COLS = P("data", "model")


def test_the_description_fits_100_columns(tmp_path, mesh42, mesh24):
    """Long keys, shardings on two meshes, a cast, 40 unread keys and a problem: every line of
    describe() (what `tpu-ckpt plan` prints) fits a 100-column terminal, no key cut."""
    deep = "params/encoder/layer_0/self_attention/query_kernel"
    arrays = {f"layer_{i:02d}_attention_output_bias": np.zeros(2, np.float32) for i in range(40)}
    state = {"params": {"encoder": {"layer_0": {"self_attention": {"query_kernel": jax.device_put(
        W, NamedSharding(mesh42, P("data", "model")))}}}, "unread": arrays}}
    tc.save(tmp_path / "c", state).wait()
    target = {"params": {"encoder": {"layer_0": {"self_attention": {"query_kernel": sds(
        (8, 8), jax.numpy.bfloat16, mesh24, P(None, ("data", "model")))}}}}}
    text = tc.check_restore(tmp_path / "c", target, devices_per_process=2).describe()
    assert _fits(text), text
    assert deep in text.split() and "params/unread/layer_39_attention_output_bias" in text.replace(",", " ").split()
    assert f"cast (float -> float): {deep}: float32 -> bfloat16" in text
    target["params"]["missing"] = np.zeros(3, np.float32)
    text = tc.check_restore(tmp_path / "c", target).describe()
    assert _fits(text) and "'params/missing'" in text, text


def _fits(text):
    """Every line fits 100 columns, but the first (the verdict, naming tmp_path: long under
    pytest-xdist) and a single word longer than that."""
    return all(len(line) <= 100 or len(line.split()) == 1 for line in text.splitlines()[1:])


def target(mesh, spec=ROWS_COLS, **changes):
    params = {"w": sds((8, 8), np.float32, mesh, spec), "i": np.zeros(4, np.int64)}
    params.update(changes)
    return {"params": params, "opt_state": {"mu": {"w": sds((8, 8), np.float32, mesh, spec)}}, "step": 0}


@pytest.mark.parametrize(
    "change, key, words",
    [
        ({"extra": np.zeros(3, np.float32)}, "params/extra", "is not in checkpoint"),
        ({"w": jax.ShapeDtypeStruct((8, 4), np.float32)}, "params/w", "has shape (8, 4)"),
        ({"i": np.zeros(4, np.float32)}, "params/i", "has dtype float32"),  # int -> float: refused
    ],
    ids=["missing key", "shape", "int to float"],
)
def test_each_mismatch_is_reported_and_is_what_restore_raises(ckpt, mesh42, change, key, words):
    bad = target(mesh42, **change)
    report = tc.check_restore(ckpt, bad)
    assert not report.ok and len(report.problems) == 1
    assert repr(key) in report.problems[0] and words in report.problems[0]
    described = report.describe().splitlines()  # the verdict, then the problem (wrapped at 100 columns)
    assert report.bytes_per_process == {} and described[1].startswith("  Target leaf")
    assert " ".join(" ".join(described[1:]).split()) == " ".join(report.problems[0].split())
    with pytest.raises(tc.TargetMismatchError) as raised:
        tc.restore(ckpt, bad)
    assert str(raised.value) == report.problems[0] and raised.value.key == key


def test_every_mismatch_is_listed_at_once_and_restore_raises_them_all(ckpt, mesh42):
    bad = target(mesh42, extra=np.zeros(3), w=jax.ShapeDtypeStruct((4, 8), np.float32), i=np.zeros(4, np.float32))
    report = tc.check_restore(ckpt, bad)
    assert [p.split("'")[1] for p in report.problems] == ["params/extra", "params/i", "params/w"]  # flatten order
    with pytest.raises(tc.TargetMismatchError) as raised:
        tc.restore(ckpt, bad)
    assert str(raised.value).splitlines()[1:] == [f"  {p}" for p in report.problems]
    assert raised.value.key == "params/extra"


def test_an_unknown_subtree_is_the_one_problem(ckpt):
    report = tc.check_restore(ckpt, subtree="nope")
    with pytest.raises(tc.TargetMismatchError) as raised:
        tc.restore(ckpt, subtree="nope")
    assert not report.ok and report.problems == [str(raised.value)]


def test_a_float_cast_is_allowed_and_listed(ckpt, mesh42):
    import ml_dtypes

    ok = target(mesh42, w=sds((8, 8), ml_dtypes.bfloat16, mesh42, P("data", "model")))
    report = tc.check_restore(ckpt, ok)
    assert report.ok and report.casts == ["params/w: float32 -> bfloat16"]
    assert "cast (float -> float): params/w: float32 -> bfloat16" in report.describe()
    assert tc.restore(ckpt, ok)["params"]["w"].dtype == ml_dtypes.bfloat16


def test_skipped_slots_and_unread_keys_are_listed_and_not_read(ckpt, mesh42):
    skip = tc.CheckpointOptions(skip_slot_variables=True)
    full = tc.check_restore(ckpt, target(mesh42))
    report = tc.check_restore(ckpt, target(mesh42), options=skip)
    assert report.ok and report.skipped_slots == ["opt_state/mu/w"] and full.skipped_slots == []
    assert report.bytes_per_process[0] == full.bytes_per_process[0] - W.nbytes
    assert tc.check_restore(ckpt, options=skip).skipped_slots == ["opt_state/mu/w"]  # no target: left out
    partial = tc.check_restore(ckpt, {"w": sds((8, 8), np.float32, mesh42, P("data", "model"))}, subtree="params")
    assert partial.ok and partial.unread_keys == ["params/i"] and [x.key for x in partial.leaves] == ["params/w"]
    assert "in the checkpoint, not in the target, not read: params/i" in partial.describe()


def test_an_identical_layout_reads_each_piece_once_with_no_over_read(ckpt, mesh42):
    report = tc.check_restore(ckpt, target(mesh42))
    assert report.ok and report.resharded == []
    arrays = 2 * W.nbytes + np.arange(4).nbytes
    assert report.bytes_per_process == {0: arrays} and report.over_read_per_process == {0: 0}
    assert report.requests_per_process[0] >= 1 and report.seconds_per_process[0] == arrays / 1e9


def test_resharding_onto_another_mesh_counts_the_over_read_the_restore_really_reads(ckpt, mesh24):
    """(4, 2) -> (2, 4): each 4x2 region is cut out of two 2x4 pieces. In batches smaller
    than a leaf, every region reads its pieces whole: twice the bytes it needs."""
    resharded = target(mesh24)
    previous = settings.configure(settings.Settings(read_batch_bytes=64))
    try:
        report = tc.check_restore(ckpt, resharded)
        _, measured = restore_counting_reads(ckpt, resharded)
    finally:
        settings.configure(previous)
    assert report.ok and report.resharded == ["opt_state/mu/w", "params/w"]  # flatten order
    assert report.over_read_per_process[0] == 2 * W.nbytes  # each w leaf read twice over
    assert (report.bytes_per_process[0], report.requests_per_process[0]) == measured
    w = next(x for x in report.leaves if x.key == "params/w")
    assert (w.read_bytes, w.over_read, w.resharded) == (2 * W.nbytes, W.nbytes, True)
    assert "data=4,model=2 P(data,model)" in w.saved and "data=2,model=4 P(data,model)" in w.restored
    # In one batch each piece is read once: the same resharding, no over-read.
    assert tc.check_restore(ckpt, resharded).over_read_per_process == {0: 0}


def test_processes_are_counted_from_the_target_shardings(ckpt, mesh24):
    """Two hosts of four devices (devices 0-3 are mesh24's first row). With columns dealt
    out one by one, host 0 needs columns 0, 2, 4, 6: every 2x4 piece, half of each wasted."""
    dealt = {"w": sds((8, 8), np.float32, mesh24, P(None, ("model", "data")))}
    report = tc.check_restore(ckpt, dealt, subtree="params", devices_per_process=4)
    assert report.bytes_per_process == {0: W.nbytes, 1: W.nbytes}
    assert report.over_read_per_process == {0: W.nbytes // 2, 1: W.nbytes // 2}
    rows = {"w": sds((8, 8), np.float32, mesh24, P("data", "model"))}  # host 0 rows 0-3: its pieces exactly
    by_rows = tc.check_restore(ckpt, rows, subtree="params", devices_per_process=4)
    assert by_rows.bytes_per_process == {0: W.nbytes // 2, 1: W.nbytes // 2}
    assert by_rows.over_read_per_process == {0: 0, 1: 0}
    one_host = tc.check_restore(ckpt, rows, subtree="params", devices_per_process=8)  # the plan's own count
    assert one_host.reads == tc.check_restore(ckpt, rows, subtree="params").reads


def test_no_data_file_is_read(ckpt, mesh24):
    for name in manifest(ckpt)["files"]:
        os.remove(os.path.join(ckpt, name if isinstance(name, str) else name[0]))
    report = tc.check_restore(ckpt, target(mesh24))
    assert report.ok and report.bytes_per_process[0] > 0
    with pytest.raises(tc.CorruptCheckpointError):
        tc.restore(ckpt, target(mesh24))
