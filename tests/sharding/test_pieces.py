"""Pieces: tree leaves -> ShardableTensors (replicas once, slice conventions)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import axis_types
from tpu_ckpt.sharding import LocalPieces, describe_sharding, index_to_slice


def test_index_to_slice_normalises_open_slices():
    assert index_to_slice((slice(None), slice(2, 4)), (8, 6)) == ((0, 8), (2, 4))
    assert index_to_slice((), ()) == ()
    with pytest.raises(ValueError, match="strided"):
        index_to_slice((slice(0, 8, 2),), (8,))


def leaf_pieces(key, leaf, process_index=0):
    local = LocalPieces(process_index)
    local.add(key, leaf)
    return local.shardable()


def test_sharded_leaf_gives_one_piece_per_distinct_shard(mesh42):
    x = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh42, P("data")))  # replicated over 'model'
    pieces = leaf_pieces("w", x, 0)
    assert [p.slice_spec for p in pieces] == [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 4)), ((6, 8), (0, 4))]
    for p in pieces:
        assert p.checkpoint_key == "w" and p.shape == (8, 4) and p.dtype == np.float64 and p.device is not None
        assert p.nbytes == 2 * 4 * 8 and p.slice_shape == (2, 4)
        start, stop = p.slice_spec[0]
        np.testing.assert_array_equal(np.asarray(p.tensor), np.arange(32.0).reshape(8, 4)[start:stop])


def test_host_values_are_written_by_process_zero_only():
    assert len(leaf_pieces("a", np.ones(3), 0)) == 1
    assert leaf_pieces("a", np.ones(3), 1) == []
    (scalar,) = leaf_pieces("s", np.float32(1), 0)
    assert scalar.slice_spec == () and scalar.nbytes == 4


def test_shardable_tensor_is_frozen_and_hashable():
    t = tc.ShardableTensor(np.ones(2), "k", ((0, 2),), (2,), np.dtype(np.float64))
    assert hash(t) == hash(tc.ShardableTensor(np.zeros(2), "k", ((0, 2),), (2,), np.dtype(np.float64)))
    with pytest.raises(AttributeError):
        t.checkpoint_key = "other"


def test_describe_sharding(mesh42):
    x = jax.device_put(np.ones((8, 4)), NamedSharding(mesh42, P(("data", "model"))))
    # jax.make_mesh's axes are Explicit on recent JAX; a mesh of Auto axes (the classic jax.sharding.Mesh) records none
    assert describe_sharding(x) == {
        "type": "NamedSharding", "mesh": {"data": 4, "model": 2}, "spec": [["data", "model"]], **axis_types(mesh42)
    }
    auto = jax.sharding.Mesh(mesh42.devices, mesh42.axis_names)
    assert "axis_types" not in describe_sharding(jax.device_put(np.ones((8, 4)), NamedSharding(auto, P("data"))))
    assert describe_sharding(np.ones(2)) is None
