"""The built-in sharding policies.

MaxShardSizePolicy cases come from TensorFlow 2.21 runs (reference §2.5, sharding_policies_test);
TF's slice-spec strings ``"full dims off,len:off,len"`` are written here as absolute
``(start, stop)`` pairs. Cases where TF loops forever or drops data check our fixes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tpu_ckpt.format import SliceSpec, full_slice
from tpu_ckpt.sharding import (
    LocalPieces,
    MaxShardSizePolicy,
    ShardableTensor,
    ShardByDevicePolicy,
    ShardByTaskPolicy,
    ShardingCallback,
    validate_shards,
)
from tpu_ckpt.sharding._pieces import Shard


def piece(
    key: str, array: Any, slice_spec: SliceSpec | None = None, shape: Sequence[int] | None = None
) -> ShardableTensor:
    """A host piece; by default the whole of its leaf."""
    array = np.asarray(array)
    spec = full_slice(array.shape) if slice_spec is None else slice_spec
    return ShardableTensor(array, key, spec, tuple(array.shape if shape is None else shape), array.dtype)


def run(policy: ShardingCallback, pieces: Sequence[ShardableTensor]) -> list[Shard]:
    """Calls the policy and checks its result validates, as a save would."""
    shards = policy(pieces)
    validate_shards(shards, pieces, policy.description)
    return shards


def plain(shards: list[Shard]) -> list[dict[str, dict[SliceSpec, Any]]]:
    """Shards with values as nested lists, for comparing with literal expectations."""
    return [{key: {spec: np.asarray(v).tolist() for spec, v in e.items()} for key, e in s.items()} for s in shards]


def max_size(pieces: Sequence[ShardableTensor], limit: int) -> list[dict[str, dict[SliceSpec, Any]]]:
    return plain(run(MaxShardSizePolicy(limit), pieces))


# --- TF 2.21 worked examples -------------------------------------------------------------------


def one_d_pieces() -> list[ShardableTensor]:
    return [
        piece("v0", np.array([0, 1, 2, 3], np.float32)),
        piece("v1", np.array([[4], [5], [6], [7]], np.int32)),
    ]


def test_1d_limit_4_one_element_per_shard():
    expected = [{"v0": {((i, i + 1),): [i]}} for i in range(4)]
    expected += [{"v1": {((i, i + 1), (0, 1)): [[4 + i]]}} for i in range(4)]
    assert max_size(one_d_pieces(), 4) == expected


@pytest.mark.parametrize("limit", [8, 10])
def test_1d_limit_8_and_10_halves(limit):
    assert max_size(one_d_pieces(), limit) == [
        {"v0": {((0, 2),): [0, 1]}},
        {"v0": {((2, 4),): [2, 3]}},
        {"v1": {((0, 2), (0, 1)): [[4], [5]]}},
        {"v1": {((2, 4), (0, 1)): [[6], [7]]}},
    ]


@pytest.mark.parametrize("limit", [16, 18])
def test_1d_limit_16_and_18_whole_tensors_with_full_slices(limit):
    assert max_size(one_d_pieces(), limit) == [
        {"v0": {((0, 4),): [0, 1, 2, 3]}},
        {"v1": {((0, 4), (0, 1)): [[4], [5], [6], [7]]}},
    ]


def two_d_pieces() -> list[ShardableTensor]:
    return [
        piece("a", np.array([[0, 1], [2, 3], [4, 5]], np.int32)),
        piece("b", np.arange(6, 12, dtype=np.float32).reshape(3, 2, 1)),
    ]


@pytest.mark.parametrize("limit", [8, 10])
def test_2d_limit_8_and_10_rows(limit):
    a = [[[0, 1]], [[2, 3]], [[4, 5]]]
    b = [[[[6], [7]]], [[[8], [9]]], [[[10], [11]]]]
    expected = [{"a": {((i, i + 1), (0, 2)): a[i]}} for i in range(3)]
    expected += [{"b": {((i, i + 1), (0, 2), (0, 1)): b[i]}} for i in range(3)]
    assert max_size(two_d_pieces(), limit) == expected


def test_2d_limit_12_splits_along_axis_1():
    assert max_size(two_d_pieces(), 12) == [
        {"a": {((0, 3), (0, 1)): [[0], [2], [4]]}},
        {"a": {((0, 3), (1, 2)): [[1], [3], [5]]}},
        {"b": {((0, 3), (0, 1), (0, 1)): [[[6]], [[8]], [[10]]]}},
        {"b": {((0, 3), (1, 2), (0, 1)): [[[7]], [[9]], [[11]]]}},
    ]


def test_2d_limit_16_packs_two_keys_into_one_shard():
    assert max_size(two_d_pieces(), 16) == [
        {"a": {((0, 2), (0, 2)): [[0, 1], [2, 3]]}},
        {"a": {((2, 3), (0, 2)): [[4, 5]]}, "b": {((0, 1), (0, 2), (0, 1)): [[[6], [7]]]}},
        {"b": {((1, 3), (0, 2), (0, 1)): [[[8], [9]], [[10], [11]]]}},
    ]


def pre_sliced_piece() -> ShardableTensor:
    """Columns 1..3 of a [2, 5] leaf (TF's ``"2 5 0,2:1,3"``)."""
    full = np.arange(10, dtype=np.float32).reshape(2, 5)
    return piece("t", full[:, 1:4], ((0, 2), (1, 4)), (2, 5))


def test_pre_sliced_limit_8_uses_absolute_offsets():
    assert max_size([pre_sliced_piece()], 8) == [
        {"t": {((0, 2), (1, 2)): [[1], [6]]}},
        {"t": {((0, 1), (2, 4)): [[2, 3]]}},
        {"t": {((1, 2), (2, 4)): [[7, 8]]}},
    ]


def test_pre_sliced_limit_12():
    assert max_size([pre_sliced_piece()], 12) == [
        {"t": {((0, 1), (1, 4)): [[1, 2, 3]]}},
        {"t": {((1, 2), (1, 4)): [[6, 7, 8]]}},
    ]


def test_packing_fills_the_rest_of_a_shard_with_the_next_tensor():
    pieces = [piece("a", np.array([0, 1, 2], np.float32)), piece("b", np.array([3, 4, 5], np.float32))]
    assert max_size(pieces, 16) == [
        {"a": {((0, 3),): [0, 1, 2]}, "b": {((0, 1),): [3]}},
        {"b": {((1, 3),): [4, 5]}},
    ]


def test_packing_a_full_shard_is_closed():
    pieces = [piece("a", np.arange(4, dtype=np.float32)), piece("b", np.array([4, 5], np.float32))]
    assert max_size(pieces, 16) == [{"a": {((0, 4),): [0, 1, 2, 3]}}, {"b": {((0, 2),): [4, 5]}}]


def test_10x10_limit_48():
    t = np.arange(100, dtype=np.float32).reshape(10, 10)
    expected = [{"t": {((i, i + 1), (0, 10)): t[i : i + 1].tolist()}} for i in range(4)]
    for spec in [((4, 10), (0, 2)), ((4, 10), (2, 4)), ((4, 6), (4, 10)), ((6, 8), (4, 10)), ((8, 10), (4, 10))]:
        expected.append({"t": {spec: t[tuple(slice(a, b) for a, b in spec)].tolist()}})
    assert max_size([piece("t", t)], 48) == expected


def test_2x50_limit_40():
    t = np.arange(100, dtype=np.float32).reshape(2, 50)
    expected = [{"t": {((0, 2), (c, c + 5)): t[:, c : c + 5].tolist()}} for c in range(0, 40, 5)]
    expected += [{"t": {((r, r + 1), (40, 50)): t[r : r + 1, 40:].tolist()}} for r in range(2)]
    assert max_size([piece("t", t)], 40) == expected


def test_3x4_limit_20():
    t = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert max_size([piece("t", t)], 20) == [
        {"t": {((0, 1), (0, 4)): [[0, 1, 2, 3]]}},
        {"t": {((1, 2), (0, 4)): [[4, 5, 6, 7]], ((2, 3), (0, 1)): [[8]]}},
        {"t": {((2, 3), (1, 4)): [[9, 10, 11]]}},
    ]


def test_int64_limit_12_wastes_space_like_tf():
    t = np.array([10, 11, 12, 13], np.int64)
    assert max_size([piece("t", t)], 12) == [{"t": {((i, i + 1),): [10 + i]}} for i in range(4)]


def test_bool_limit_2():
    t = np.array([True, False, True, True, False])
    assert max_size([piece("t", t)], 2) == [
        {"t": {((0, 2),): [True, False]}},
        {"t": {((2, 4),): [True, True]}},
        {"t": {((4, 5),): [False]}},
    ]


def test_scalars_are_packed_whole():
    pieces = [piece(k, np.float32(v)) for k, v in [("x", 1), ("y", 2), ("z", 3)]]
    assert max_size(pieces, 8) == [{"x": {(): 1.0}, "y": {(): 2.0}}, {"z": {(): 3.0}}]


def test_oversized_scalar_gets_its_own_shard():
    assert max_size([piece("f", np.float32(7))], 2) == [{"f": {(): 7.0}}]


def test_oversized_scalar_comes_last():
    pieces = [piece("s", np.float64(9)), piece("f", np.array([1, 2], np.int16))]
    assert max_size(pieces, 4) == [{"f": {((0, 2),): [1, 2]}}, {"s": {(): 9.0}}]


# --- TF defects, fixed ---------------------------------------------------------------------------


def test_element_larger_than_limit_overflows_alone_instead_of_looping():
    t = np.array([1.5, 2.5], np.float64)
    assert max_size([piece("t", t)], 4) == [{"t": {((0, 1),): [1.5]}}, {"t": {((1, 2),): [2.5]}}]


def test_2x2_limit_4_is_cut_to_single_elements():
    t = np.arange(4, dtype=np.float32).reshape(2, 2)
    assert max_size([piece("t", t)], 4) == [
        {"t": {((i, i + 1), (j, j + 1)): [[2 * i + j]]}} for i in range(2) for j in range(2)
    ]


def test_3x3_limit_8_terminates_and_covers_exactly():
    t = np.arange(9, dtype=np.float32).reshape(3, 3)
    assert max_size([piece("t", t)], 8) == [
        {"t": {((0, 1), (0, 2)): [[0, 1]]}},
        {"t": {((0, 1), (2, 3)): [[2]]}},
        {"t": {((1, 3), (0, 1)): [[3], [6]]}},
        {"t": {((1, 2), (1, 3)): [[4, 5]]}},
        {"t": {((2, 3), (1, 3)): [[7, 8]]}},
    ]


def test_rank_3_slabs_along_the_axis_needing_fewest_cuts():
    t = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    specs = [
        [((0, 2), (0, 1), (0, 4))],
        [((0, 1), (1, 3), (0, 4)), ((1, 2), (1, 3), (0, 1))],
        [((1, 2), (1, 3), (1, 4))],
    ]
    expected = [{"t": {s: t[tuple(slice(a, b) for a, b in s)].tolist() for s in shard}} for shard in specs]
    assert max_size([piece("t", t)], 40) == expected


def test_rank_3_unfittable_block_is_cut_to_elements_in_order():
    t = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    expected = [{"t": {tuple((i, i + 1) for i in index): [[[float(t[index])]]]}} for index in np.ndindex(2, 2, 2)]
    assert max_size([piece("t", t)], 4) == expected


def test_oversized_element_leaves_no_empty_shard_and_comes_last():
    pieces = [piece("b", np.array([True, False, True])), piece("f", np.array([5], np.float32))]
    assert max_size(pieces, 2) == [
        {"b": {((0, 2),): [True, False]}},
        {"b": {((2, 3),): [True]}},
        {"f": {((0, 1),): [5.0]}},
    ]


def test_zero_size_arrays_are_kept_in_the_current_shard():
    pieces = [
        piece("a", np.array([0, 1, 2], np.float32)),
        piece("e", np.zeros((0,), np.float32)),
        piece("m", np.zeros((2, 0, 3), np.int8)),
    ]
    assert max_size(pieces, 8) == [
        {"a": {((0, 2),): [0, 1]}},
        {"a": {((2, 3),): [2]}, "e": {((0, 0),): []}, "m": {((0, 2), (0, 0), (0, 3)): [[], []]}},
    ]


def test_only_zero_size_arrays():
    assert max_size([piece("e", np.zeros((0, 4), np.float32))], 1) == [{"e": {((0, 0), (0, 4)): []}}]


def test_empty_input_gives_no_shards():
    assert MaxShardSizePolicy(8)([]) == []
    assert ShardByTaskPolicy()([]) == []
    assert ShardByDevicePolicy()([]) == []


def test_slices_of_jax_arrays_stay_jax_arrays():
    t = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    shards = run(MaxShardSizePolicy(12), [ShardableTensor(t, "t", full_slice(t.shape), t.shape, np.dtype("float32"))])
    assert [list(s["t"]) for s in shards] == [[((0, 1), (0, 3))], [((1, 2), (0, 3))]]
    assert all(isinstance(v, jax.Array) for s in shards for v in s["t"].values())
    assert plain(shards) == [{"t": {((0, 1), (0, 3)): [[0, 1, 2]]}}, {"t": {((1, 2), (0, 3)): [[3, 4, 5]]}}]


# --- Constructor and hashing ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10", None])
def test_max_shard_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_shard_size"):
        MaxShardSizePolicy(bad)


def test_hash_follows_configuration_and_equality_is_identity():
    assert hash(MaxShardSizePolicy(10)) == hash(MaxShardSizePolicy(10))
    assert hash(MaxShardSizePolicy(10)) != hash(MaxShardSizePolicy(11))
    assert hash(ShardByTaskPolicy()) == hash(ShardByTaskPolicy())
    assert MaxShardSizePolicy(10) != MaxShardSizePolicy(10)


def test_descriptions():
    for policy in [ShardByDevicePolicy(), ShardByTaskPolicy(), MaxShardSizePolicy(8)]:
        assert isinstance(policy.description, str) and policy.description


# --- Random shapes and limits --------------------------------------------------------------------


DTYPES = [np.bool_, np.int8, np.float16, np.int32, np.float32, np.int64, np.float64]


def random_piece(rng: np.random.Generator, key: str) -> ShardableTensor:
    """A random leaf of rank 0..3, sometimes given as a sub-block (pre-sliced piece)."""
    dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
    shape = tuple(int(n) for n in rng.integers(0, 6, size=rng.integers(0, 4)))
    leaf = (rng.standard_normal(shape) * 20).astype(dtype)
    if not shape or rng.random() < 0.5:
        return piece(key, leaf)
    starts = [int(rng.integers(0, n + 1)) for n in shape]
    spec = tuple((a, int(rng.integers(a, n + 1))) for a, n in zip(starts, shape))
    return piece(key, leaf[tuple(slice(a, b) for a, b in spec)], spec, shape)


def shard_nbytes(shard: Shard, dtypes: dict[str, np.dtype]) -> int:
    return sum(math.prod(b - a for a, b in spec) * dtypes[key].itemsize for key, e in shard.items() for spec in e)


def assert_reassembles(shards: list[Shard], pieces: Sequence[ShardableTensor]) -> None:
    """Each piece equals the output blocks inside it put back in place (validation proved exact cover)."""
    for p in pieces:
        out = np.zeros(p.slice_shape, p.dtype)
        for shard in shards:
            for spec, value in shard.get(p.checkpoint_key, {}).items():
                if all(s <= a and b <= t for (a, b), (s, t) in zip(spec, p.slice_spec)):
                    out[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(spec, p.slice_spec))] = value
        np.testing.assert_array_equal(out, p.tensor)


def test_random_shapes_and_limits_always_valid_bounded_and_lossless():
    rng = np.random.default_rng(20240521)
    for _ in range(200):
        pieces = [random_piece(rng, f"k{i}") for i in range(rng.integers(1, 5))]
        limit = int(rng.integers(1, 100))
        shards = run(MaxShardSizePolicy(limit), pieces)
        dtypes = {p.checkpoint_key: np.dtype(p.dtype) for p in pieces}
        for shard in shards:
            assert shard
            if shard_nbytes(shard, dtypes) > limit:
                ((key, entries),) = shard.items()
                ((spec, _),) = entries.items()
                assert math.prod(b - a for a, b in spec) == 1 and dtypes[key].itemsize > limit
        assert_reassembles(shards, pieces)


# --- Device and task policies on real sharded arrays ---------------------------------------------


def mesh_pieces() -> list[ShardableTensor]:
    """A 2D-sharded leaf, a leaf replicated over mesh axis y (4 distinct pieces), and a host value."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    w = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, PartitionSpec("x", "y")))
    b = jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, PartitionSpec("x")))
    local = LocalPieces(0)
    for key, leaf in (("w", w), ("b", b), ("h", np.ones(3, np.float64))):
        local.add(key, leaf)
    return local.shardable()


def entries(shard: Shard) -> set[tuple[str, SliceSpec]]:
    return {(key, spec) for key, e in shard.items() for spec in e}


def test_shard_by_device_one_shard_per_device_in_first_seen_order():
    pieces = mesh_pieces()
    assert len(pieces) == 8 + 4 + 1
    shards = run(ShardByDevicePolicy(), pieces)
    devices = list(dict.fromkeys(p.device for p in pieces))
    assert len(devices) == 9 and devices[-1] is None
    assert [entries(s) for s in shards] == [
        {(p.checkpoint_key, p.slice_spec) for p in pieces if p.device == d} for d in devices
    ]
    assert shards[-1] == {"h": {((0, 3),): pieces[-1].tensor}}


def test_shard_by_task_one_shard_with_every_piece():
    pieces = mesh_pieces()
    (shard,) = run(ShardByTaskPolicy(), pieces)
    assert entries(shard) == {(p.checkpoint_key, p.slice_spec) for p in pieces}
    assert all(shard[p.checkpoint_key][p.slice_spec] is p.tensor for p in pieces)


@pytest.mark.parametrize("policy", [ShardByDevicePolicy, ShardByTaskPolicy])
def test_device_and_task_policies_take_any_iterable(policy):
    """A callback wrapping a built-in one may hand it a generator: read once, as a list."""
    pieces = mesh_pieces()
    assert [entries(s) for s in policy()(p for p in pieces)] == [entries(s) for s in policy()(pieces)]
    assert policy()(iter([])) == []


def test_max_shard_size_on_sharded_pieces_splits_each_piece():
    pieces = mesh_pieces()
    shards = run(MaxShardSizePolicy(8), pieces)
    assert_reassembles(shards, pieces)
    assert entries(shards[0]) == {("w", ((0, 1), (0, 2)))}
