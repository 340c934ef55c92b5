"""A save holds one host copy of each piece, and lets go of it once its file is written."""

import collections
import json
import os
import subprocess
import sys
import weakref

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import PlannedPiece, full_slice
from tpu_ckpt.saving._data_writes import Writes, _private_host_value, fetch_started, write_all
from tpu_ckpt.saving._plan import DataFile
from tpu_ckpt.storage import make_directory

SLACK = 96 << 20  # interpreter, allocator and page-table noise


def test_a_fetched_host_value_is_the_snapshot_and_stays_off_the_callers_array():
    """JAX copies a sharded array's value into host memory of its own when asked for it on
    CPU too, as it copies every value it fetches from a TPU or GPU: that copy is the snapshot,
    and it is cached on the save's own handle, not on the caller's array."""
    mesh = jax.make_mesh((8,), ("d",))
    expected = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    x = jax.device_put(expected, NamedSharding(mesh, P("d")))
    handle = fetch_started(x)
    host = _private_host_value(handle)
    assert host is handle._npy_value  # no second copy made
    assert x._npy_value is None  # the caller's array keeps no host value of the save's
    np.testing.assert_array_equal(host, expected)
    x.delete()
    np.testing.assert_array_equal(host, expected)


def test_a_cpu_buffer_is_copied_once():
    """On CPU numpy views the device buffer itself: the snapshot must be a copy of it."""
    x = jax.device_put(np.arange(1000, dtype=np.int32), jax.devices()[0])
    host = _private_host_value(fetch_started(x))
    assert not np.shares_memory(host, np.asarray(x))
    np.testing.assert_array_equal(host, np.arange(1000))


@pytest.mark.accelerator
@pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs a TPU or GPU (scripts/accelerator_check.sh runs it)")
def test_off_cpu_the_fetched_host_value_is_the_snapshot():
    """Off CPU every fetch is a copy JAX made, whether or not it caches it as ``_npy_value``
    (jax 0.11 on a GPU does not): the snapshot is that copy, not a second one."""
    expected = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    x = jax.device_put(expected, jax.devices()[0])
    handle = fetch_started(x)
    host = _private_host_value(handle)
    assert np.shares_memory(host, np.asarray(handle))  # no second host copy
    x.delete()
    np.testing.assert_array_equal(host, expected)


def test_each_file_is_let_go_once_written(tmp_path):
    """Each file's host bytes are freed once it is written, while the store is still open
    (an idle IO thread keeps nothing of its last job)."""
    location = storage.location(tmp_path / "c")
    make_directory(location.local_path)
    arrays = [np.full((256, 256), i, np.float32) for i in range(3)]
    alive = [weakref.ref(a) for a in arrays]
    files = collections.deque(
        DataFile(f"d{i}.safetensors", (PlannedPiece(f"k{i}", full_slice(a.shape), a, a.nbytes),), a.nbytes)
        for i, a in enumerate(arrays)
    )
    del arrays
    store = storage.Store(location, threads=1)
    try:
        index = write_all(Writes(store, None), files)
        assert not files
        assert [ref() is None for ref in alive] == [True, True, True]
    finally:
        store.close()
    assert sorted(index.files) == [f"d{i}.safetensors" for i in range(3)]


def _probe(tmp_path, mode: str) -> dict:
    megabytes = 256  # 4 shards of 64 MiB
    probe = os.path.join(os.path.dirname(__file__), "host_copies_probe.py")
    out = subprocess.run(
        [sys.executable, probe, str(tmp_path), str(megabytes), mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_async_save_holds_one_host_copy_and_reuses_it(tmp_path):
    grown = _probe(tmp_path, "reuse")
    state = grown["state_bytes"]
    assert grown["first"]["peak"] <= state + SLACK, grown  # one host copy, never two
    assert grown["first"]["after"] >= state - SLACK, grown  # kept for the next snapshot
    assert grown["second"]["peak"] <= SLACK, grown  # which copies into it: no new memory
    assert grown["second"]["after"] <= SLACK, grown
    assert grown["second_restores_exactly"], grown


@pytest.mark.slow
def test_async_save_without_reuse_leaves_no_copy(tmp_path):
    grown = _probe(tmp_path, "no-reuse")
    state = grown["state_bytes"]
    for save in ("first", "second"):
        assert grown[save]["peak"] <= state + SLACK, grown
        assert grown[save]["after"] <= SLACK, grown  # none left once the save is done


def test_a_failed_write_leaves_no_other_write_running(tmp_path):
    """The first of four files cannot be written (its name is taken by a directory): when
    the error reaches the caller, the three bigger writes started after it have finished,
    so none still reads the caller's buffers (which it may donate once the save raised)."""
    location = storage.location(tmp_path / "c")
    make_directory(location.local_path)
    os.mkdir(os.path.join(location.local_path, "d0.safetensors"))
    arrays = [np.full(1 << 10, 0, np.float32)] + [np.full(16 << 20, i, np.float32) for i in (1, 2, 3)]
    files = collections.deque(
        DataFile(f"d{i}.safetensors", (PlannedPiece(f"k{i}", full_slice(a.shape), a, a.nbytes),), a.nbytes)
        for i, a in enumerate(arrays)
    )
    store = storage.Store(location, threads=4)
    try:
        with pytest.raises(CheckpointError, match="d0.safetensors"):
            write_all(Writes(store, None), files)
        sizes = [os.path.getsize(os.path.join(location.local_path, f"d{i}.safetensors")) for i in (1, 2, 3)]
        assert all(size > arrays[1].nbytes for size in sizes), sizes  # header and data, all there
    finally:
        store.close()
