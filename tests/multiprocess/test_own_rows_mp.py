"""A restoring process reads only its own piece-table rows (#21): in a two-process job each
process needs half of every leaf, and reads the rows of those cells, in runs, at most twice
their bytes, building a piece entry for each of its cells only; and its one store serves the
manifest once."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LEAVES, SHAPE = 3, (32, 16)


def own_rows(directory: str) -> dict:
    import tpu_ckpt as tc
    from tests.support.helpers import CountingStore
    from tpu_ckpt import catalog, restoring, storage

    mesh = jax.make_mesh((4, 2), ("data", "model"))  # process 0 holds mesh rows 0-1: cells 0-3 of each leaf
    sharding = NamedSharding(mesh, P("data", "model"))
    values = {f"l{i}": np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + i for i in range(LEAVES)}
    tree = {k: jax.make_array_from_callback(SHAPE, sharding, lambda index, v=v: v[index]) for k, v in values.items()}
    path = os.path.join(directory, "ckpt")
    tc.save(path, tree).wait()
    target = {k: jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding) for k in values}
    with CountingStore(storage.Store(storage.location(path))) as store, catalog.open_checkpoint(store) as checkpoint:
        restored, _, _ = restoring.restore_from(checkpoint, target, tc.CheckpointOptions(), None, None)
        entries = sum(len(leaf.pieces.so_far()) for leaf in checkpoint.manifest.leaves)
    exact = all(
        np.array_equal(np.asarray(s.data), values[k][s.index])
        for k, a in restored.items() for s in a.addressable_shards
    )
    table = sum(n for name, n in store.read_bytes.items() if name.startswith("pieces-"))
    return {
        "exact": exact, "entries": entries, "table_bytes": table,
        "manifest_reads": store.whole_reads.count("manifest.json"),
    }


def test_each_process_reads_only_its_own_rows(tmp_path):
    results = process_group.run("multiprocess.test_own_rows_mp.own_rows", 2, str(tmp_path))
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output
        own = LEAVES * 4  # 4 of each leaf's 8 cells
        assert r.result["exact"] and r.result["manifest_reads"] == 1
        assert r.result["entries"] == own  # every process built every leaf's 8 before
        assert 16 * own <= r.result["table_bytes"] <= 2 * 16 * own
