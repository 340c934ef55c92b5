"""Partial restores from a cold page cache fetch what they need, not the readahead around it.

Counted as /proc/self/io read_bytes (what the block device delivered) after evicting the
checkpoint's files, so readahead and page-fault read-around show up; rchar would not."""

import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import tpu_ckpt as tc
from tests.support.helpers import evict, leaf, manifest, storage_reads

MB = 1 << 20
# Four 1 MiB kernels, and Adam's mu and nu of each: 12 MiB, params first in the file.
PARAMS = {f"w{i}": jnp.full((512, 512), i, jnp.float32) for i in range(4)}


def evictable_dir(candidates: list[str]) -> str:
    """The first directory where an evicted file is fetched from a device again when read
    (not tmpfs or overlay, where read_bytes stays 0)."""
    for candidate in candidates:
        with tempfile.NamedTemporaryFile(dir=candidate) as probe:
            probe.write(os.urandom(MB))
            probe.flush()
            os.fsync(probe.fileno())
            evict(probe.name)
            before = storage_reads()
            os.pread(probe.fileno(), MB, 0)
            if storage_reads() - before >= MB:
                return candidate
    pytest.skip(f"no directory among {candidates} reads from a block device (tmpfs or overlay only)")


@pytest.fixture
def adam_ckpt(tmp_path):
    where = evictable_dir([str(tmp_path), "/var/tmp"])
    path = tempfile.mkdtemp(dir=where, prefix="cold_reads-") + "/c"
    state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.adam(1e-3))
    tc.save(path, state)
    yield path
    shutil.rmtree(os.path.dirname(path))


def cold_read(path: str, restore) -> int:
    evict(path)
    before = storage_reads()
    restore()
    return storage_reads() - before


def test_partial_restores_fetch_little_beyond_their_pieces(adam_ckpt):
    path = adam_ckpt
    doc = manifest(path)
    nfiles = len(doc["files"]) + len(doc.get("tables", [])) + 1  # and the manifest

    def needed(keys) -> int:
        return sum(p["length"] for key in keys for p in leaf(path, key)["pieces"])

    def bound(keys) -> float:
        return 1.2 * needed(keys) + nfiles * MB

    non_slots = [e["key"] for e in doc["leaves"] if not e.get("is_slot") and e["kind"] == "array"]
    params = [k for k in non_slots if k.startswith("params/")]
    full = cold_read(path, lambda: tc.restore(path))
    assert full >= needed([e["key"] for e in doc["leaves"] if e["kind"] == "array"])  # eviction works
    serving = cold_read(path, lambda: tc.restore(path, options=tc.CheckpointOptions(skip_slot_variables=True)))
    assert serving <= bound(non_slots), (serving, needed(non_slots), full)
    subtree = cold_read(path, lambda: tc.restore(path, subtree="params"))
    assert subtree <= bound(params), (subtree, needed(params), full)
    one = {"params": {"w2": jax.ShapeDtypeStruct((512, 512), jnp.float32)}}
    part = cold_read(path, lambda: np.testing.assert_array_equal(np.asarray(tc.restore(path, one)["params"]["w2"]), 2))
    assert part <= bound(["params/w2"]), (part, needed(["params/w2"]), full)
