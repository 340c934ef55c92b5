"""Object stores: data files planned as objects of at most ``object_bytes`` (bounded_files.py),
written without holding more than a few objects, and read with many ranged requests in
flight, each range copied once at most (object_store.py)."""

import json
import os
import subprocess
import sys
import uuid

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import bits
from tests.support.object_stores import Bucket
from tpu_ckpt import storage
from tpu_ckpt.format import data_file_bytes
from tpu_ckpt.saving import plan_save
from tpu_ckpt.settings import Settings
from tpu_ckpt.storage import _objects as object_store


def tree(mesh) -> dict:
    return {
        "big": np.arange(96 * 70, dtype=np.float32).reshape(96, 70),  # 26,880 B: cut into slabs
        "wide": np.arange(3 * 5 * 700, dtype=np.int16).reshape(3, 5, 700),  # rows of 1,400 B
        "sharded": jax.device_put(
            np.arange(64 * 32, dtype=np.float64).reshape(64, 32), NamedSharding(mesh, P("data", "model"))
        ),
        "tiny": {f"t{i:03d}": np.full((1,), i, np.int32) for i in range(300)},  # headers outweigh data
        "scalar": np.float32(2.5),
        "empty": np.zeros((0, 4), np.float32),
        "step": 3,
    }


def planned_bytes(file) -> int:
    """The size of the data file as a save writes it (``save._start_write``)."""
    return data_file_bytes(file.name, file.pieces).size


def assembled(plan, key: str, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A leaf put together from the plan's pieces, and how many pieces cover each element."""
    out, cover = np.zeros_like(like), np.zeros(like.shape, np.int64)
    for file in plan.files:
        for piece in file.pieces:
            if piece.key == key:
                region = tuple(slice(a, b) for a, b in piece.slice)
                out[region] = np.asarray(piece.data)
                cover[region] += 1
    return out, cover


def test_the_plan_bounds_every_file_and_its_pieces_still_tile_every_leaf(mesh42):
    state, bound = tree(mesh42), 12_000
    unbounded = plan_save(state, process_index=0, process_count=1)
    plan = plan_save(state, process_index=0, process_count=1, max_file_bytes=bound)
    assert len(unbounded.files) == 9 and max(map(planned_bytes, unbounded.files)) > 30_000
    sizes = [planned_bytes(f) for f in plan.files]
    assert max(sizes) <= bound and len(plan.files) > 9, sizes
    assert [f.name for f in plan.files] == [f"d00000-{i:05d}.safetensors" for i in range(len(plan.files))]
    big = [p for f in plan.files for p in f.pieces if p.key == "big"]
    assert len(big) > 2 and all(p.nbytes <= bound for p in big)  # cut into sub-blocks
    assert any(len([p for p in f.pieces if p.key.startswith("tiny/")]) > 1 for f in plan.files)
    leaves = {
        "big": state["big"], "wide": state["wide"], "sharded": np.asarray(state["sharded"]), "empty": state["empty"]
    }
    leaves |= {f"tiny/{k}": v for k, v in state["tiny"].items()}
    for key, value in leaves.items():
        out, cover = assembled(plan, key, value)
        assert (cover == 1).all(), key
        np.testing.assert_array_equal(out, value)
    (scalar,) = [p.data for f in plan.files for p in f.pieces if p.key == "scalar"]
    assert scalar == np.float32(2.5)
    assert plan.manifest == unbounded.manifest  # the same leaves: only the files differ


def test_bounded_files_view_only_the_pieces_they_cut():
    """Issue 28: a numpy view held for every piece cost ~1 KB each, outside host_memory_limit;
    a piece that fits keeps its device array, and only a cut piece is sliced from a view."""
    small = {f"s{i}": jax.numpy.full((256,), i, jax.numpy.float32) for i in range(8)}
    big = jax.numpy.arange(4096, dtype=jax.numpy.float32)
    plan = plan_save({"small": small, "big": big}, process_index=0, process_count=1, max_file_bytes=8192)
    pieces = [p for f in plan.files for p in f.pieces]
    whole = [p for p in pieces if p.key.startswith("small/") and p.slice == ((0, 256),)]
    assert len(whole) >= 6 and all(p.data is small[p.key[len("small/"):]] for p in whole)
    cut = [p for p in pieces if p.key == "big" or p.slice != ((0, 256),)]
    assert len(cut) > 2 and all(isinstance(p.data, np.ndarray) for p in cut)
    big_pieces = sorted((p for p in cut if p.key == "big"), key=lambda p: p.slice)
    np.testing.assert_array_equal(np.concatenate([p.data for p in big_pieces]), np.asarray(big))


def test_a_custom_callbacks_files_are_cut_too():
    options = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(1 << 20))
    plan = plan_save(
        {"w": np.ones((64, 64), np.float32)}, options, process_index=0, process_count=1, max_file_bytes=4096
    )
    # A sixteenth of the bound is kept for headers: slabs of 15 rows of 64 float32 (3,840 B).
    assert len(plan.files) == 5 and max(map(planned_bytes, plan.files)) <= 4096


def test_a_save_to_memory_writes_objects_within_the_bound_and_restores(knobs, mesh42):
    knobs(object_bytes=12_000)
    state = tree(mesh42)
    url = f"memory://bounded-{uuid.uuid4().hex[:8]}/c"
    tc.save(url, state).wait()
    with storage.Store(storage.location(url)) as store:
        objects = {name: len(store.read_file(name)) for name in store.list() if name.endswith(".safetensors")}
    assert len(objects) > 9 and max(objects.values()) <= 12_000, objects
    out = tc.restore(url)
    np.testing.assert_array_equal(bits(out["sharded"]), bits(state["sharded"]))
    np.testing.assert_array_equal(out["big"], state["big"])
    assert out["big"].flags.writeable and out["tiny"]["t007"].flags.writeable  # numpy results are the user's
    assert out["tiny"]["t299"][0] == 299 and out["scalar"] == np.float32(2.5) and out["empty"].shape == (0, 4)


@pytest.mark.emulator
def test_the_bucket_holds_no_object_above_the_bound(bucket, knobs, mesh42):
    knobs(object_bytes=12_000)
    state = {key: value for key, value in tree(mesh42).items() if key != "tiny"}  # fewer requests
    tc.save(bucket.url("c"), state).wait()
    sizes = {k: v for k, v in bucket.sizes("c/").items() if k.endswith(".safetensors")}  # not the manifest
    assert len(sizes) > 10 and max(sizes.values()) <= 12_000, sizes
    out = tc.restore(bucket.url("c"))
    np.testing.assert_array_equal(bits(out["sharded"]), bits(state["sharded"]))
    np.testing.assert_array_equal(bits(out["wide"]), bits(state["wide"]))


def test_a_read_is_cut_into_requests_and_copies_only_what_spans_several(monkeypatch):
    monkeypatch.setattr(object_store, "REQUEST_BYTES", 256)
    lengths = [100, 50, 600, 30, 0, 64, 256]
    assert object_store.request_ranges(10, lengths) == [(10, 160), (160, 416), (416, 672), (672, 854), (854, 1110)]
    assert object_store.request_ranges(10, [0]) == [(10, 10)]
    data = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)
    url = f"memory://ranges-{uuid.uuid4().hex[:8]}/c"
    with storage.Store(storage.location(url)) as store:
        store.write("f", [data.tobytes()]).result()
        chunks = store.read("f", 10, lengths).result()
    at = 10
    for n, chunk in zip(lengths, chunks):
        np.testing.assert_array_equal(chunk, data[at : at + n])
        at += n
    assert [c.flags.writeable for c in chunks] == [False, False, True, False, False, False, False]
    assert chunks[2].ctypes.data % 64 == 0  # the copy: fresh and aligned
    with storage.Store(storage.location(url)) as store:
        piece, _, after = store.read("f", 64, [100, 28, 64]).result()  # pieces at multiples of 64
    assert piece.ctypes.data % 16 == 0 and after.ctypes.data % 16 == 0  # views: aligned for any dtype


@pytest.mark.emulator
def test_reads_keep_the_configured_number_of_requests_in_flight(faulty, monkeypatch, knobs):
    proxy, bucket = faulty
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: 64 requests of 64 KiB
    tc.save(bucket.url("c"), {"x": x}).wait()
    monkeypatch.setattr(object_store, "REQUEST_BYTES", 64 << 10)
    # A distant store: requests pile up unless they are sent together. A long delay, so that
    # a loaded machine still issues them all before the first answers (never more than allowed).
    # Only the data file's reads wait: the manifest's and index's come one after another.
    proxy.delay_s, proxy.delayed = 1.0, lambda method, path: ".safetensors" in path
    np.testing.assert_array_equal(tc.restore(bucket.url("c"))["x"], x)
    assert 24 <= proxy.most_in_flight <= Settings().object_reads_in_flight == 32, proxy.most_in_flight
    knobs(object_reads_in_flight=48)  # more than tensorstore's default limit for the process
    proxy.most_in_flight = 0
    np.testing.assert_array_equal(tc.restore(bucket.url("c"))["x"], x)
    assert 32 < proxy.most_in_flight <= 48, proxy.most_in_flight


@pytest.mark.emulator
@pytest.mark.slow
def test_a_big_sync_save_holds_a_few_objects_and_writes_none_above_the_bound(s3_server):
    """512 MiB in objects of 32 MiB, with pieces both smaller and bigger than an object: 16
    objects at least, and a bound (320 MiB) well under the state. The peak follows the object
    size, not the state (64 MiB objects: 1 GiB measured +327 to +384 MiB, 2 GiB +383 to +508
    MiB, whose pieces are more often cut across their rows and made contiguous to be
    written); half the bytes and objects of 1 GiB / 64 MiB, in half the time against moto."""
    bucket, object_bytes = Bucket(s3_server, f"big-save-{uuid.uuid4().hex[:8]}"), 32 << 20
    probe = os.path.join(os.path.dirname(__file__), "object_write_probe.py")
    done = subprocess.run(
        [sys.executable, probe, bucket.url("c"), "512", str(object_bytes)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exact"] and result["state_bytes"] == 1 << 29
    # Each write in flight holds tensorstore's copy of its object, and the one being issued
    # up to three more for a moment (object_store.py): writes_in_flight + 4 objects at most
    # in the worst case, 2 * writes_in_flight for the default 4. The slack, test_memory's,
    # covers the interpreter's, the allocator's and tensorstore's HTTP buffers.
    assert result["save_peak"] <= 2 * object_bytes * Settings().writes_in_flight + (64 << 20), result
    sizes = bucket.sizes("c/")
    data = {k: v for k, v in sizes.items() if k.endswith(".safetensors")}
    assert len(data) >= 16 and max(data.values()) <= object_bytes, sizes
    assert sum(data.values()) > 1 << 29


@pytest.mark.emulator
@pytest.mark.slow
def test_host_memory_limit_bounds_a_save_to_an_object_store(s3_server):
    """Under host_memory_limit=128 MiB a 512 MiB sync save to S3 holds at most the limit +
    64 MiB: files are cut to a third of the limit's share (each object is held up to three
    times while written: Location.write_copies)."""
    bucket, limit = Bucket(s3_server, f"limited-{uuid.uuid4().hex[:8]}"), 128 << 20
    probe = os.path.join(os.path.dirname(__file__), "object_write_probe.py")
    done = subprocess.run(
        [sys.executable, probe, bucket.url("c"), "512", str(Settings().object_bytes), str(limit)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exact"], result
    assert result["save_peak"] <= limit + (64 << 20), result
    data = {k: v for k, v in bucket.sizes("c/").items() if k.endswith(".safetensors")}
    assert max(data.values()) <= limit // 3 // Settings().writes_in_flight, data
