"""validate_shards: one test per check (TF's sharding_util_test cases plus ours), and passing cases."""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_ckpt.errors import InvalidShardsError
from tpu_ckpt.format import SliceSpec
from tpu_ckpt.sharding import MaxShardSizePolicy, ShardableTensor, ShardByTaskPolicy, validate_shards

DESCRIPTION = "test callback"
PREFIX = f"Sharding callback '{DESCRIPTION}' returned an invalid result: "

LEAF = np.arange(24, dtype=np.float32).reshape(4, 6)
W_TOP = ((0, 2), (0, 6))
W_BOTTOM = ((2, 4), (0, 6))


def block(spec: SliceSpec, leaf: np.ndarray = LEAF) -> np.ndarray:
    return leaf[tuple(slice(a, b) for a, b in spec)]


def pieces() -> list[ShardableTensor]:
    """Leaf ``w`` [4, 6] in two row pieces, and a scalar ``s``."""
    return [
        ShardableTensor(block(W_TOP), "w", W_TOP, LEAF.shape, LEAF.dtype),
        ShardableTensor(block(W_BOTTOM), "w", W_BOTTOM, LEAF.shape, LEAF.dtype),
        ShardableTensor(np.int32(7), "s", (), (), np.dtype(np.int32)),
    ]


def whole() -> dict[str, dict[SliceSpec, Any]]:
    """One shard holding every piece as is."""
    return {"w": {W_TOP: block(W_TOP), W_BOTTOM: block(W_BOTTOM)}, "s": {(): np.int32(7)}}


def invalid(shards: Any, *fragments: str, key: str | None = None, max_grid_cells: int = 1 << 20) -> None:
    """Asserts validation fails with the common prefix, every fragment in the message, and ``key``."""
    with pytest.raises(InvalidShardsError) as info:
        validate_shards(shards, pieces(), DESCRIPTION, max_grid_cells=max_grid_cells)
    message = str(info.value)
    assert message.startswith(PREFIX), message
    for fragment in fragments:
        assert fragment in message, message
    assert info.value.key == key
    assert isinstance(info.value, ValueError)


# --- Passing cases ------------------------------------------------------------------------------


def test_whole_pieces_in_one_shard_pass():
    validate_shards([whole()], pieces(), DESCRIPTION)


def test_cut_pieces_spread_over_shards_pass_and_empty_shards_are_allowed():
    shards = (
        {},
        {"w": {((0, 2), (0, 2)): block(((0, 2), (0, 2))), ((2, 4), (0, 2)): block(((2, 4), (0, 2)))}},
        {"w": {((0, 2), (2, 6)): block(((0, 2), (2, 6))), ((2, 4), (2, 6)): block(((2, 4), (2, 6)))}},
        {"s": {(): np.int32(7)}},
    )
    validate_shards(shards, pieces(), DESCRIPTION)


def test_policy_outputs_pass():
    for policy in [ShardByTaskPolicy(), MaxShardSizePolicy(20), MaxShardSizePolicy(1)]:
        validate_shards(policy(pieces()), pieces(), DESCRIPTION)


def test_jax_arrays_on_this_process_pass():
    shard = whole()
    shard["w"] = {spec: jnp.asarray(block(spec)) for spec in (W_TOP, W_BOTTOM)}
    validate_shards([shard], pieces(), DESCRIPTION)


def test_numpy_integer_bounds_are_accepted():
    shard = whole()
    spec = tuple((np.int64(a), np.int64(b)) for a, b in W_TOP)
    shard["w"] = {spec: block(W_TOP), W_BOTTOM: block(W_BOTTOM)}
    validate_shards([shard], pieces(), DESCRIPTION)


def test_zero_size_piece_covered_by_its_empty_slice_passes():
    empty = np.zeros((0, 3), np.float32)
    piece = ShardableTensor(empty, "e", ((0, 0), (0, 3)), (0, 3), empty.dtype)
    validate_shards([{"e": {((0, 0), (0, 3)): empty}}], [piece], DESCRIPTION)


# --- Result structure ---------------------------------------------------------------------------


def test_result_must_be_a_list():
    invalid(whole(), "expected a list of shards, got dict")


def test_shard_must_be_a_dict():
    invalid([[whole()]], "shard 0 is a list")


def test_entries_must_be_a_dict():
    invalid([{"w": [block(W_TOP)]}], "shard 0, checkpoint key 'w'", "got list", key="w")


@pytest.mark.parametrize(
    "spec",
    [((0, 2),), ((0, 2), (0, 6), (0, 1)), ((0, 2.0), (0, 6)), ((0, 2), (False, True)), ((0, 2, 1), (0, 6))],
)
def test_slice_spec_must_be_int_pairs_of_the_leaf_rank(spec):
    shard = whole()
    shard["w"] = {spec: block(W_TOP), W_BOTTOM: block(W_BOTTOM)}
    invalid([shard], "checkpoint key 'w'", f"slice {spec!r}", "2 (start, stop) int pairs", key="w")


def test_array_must_be_an_array():
    shard = whole()
    shard["s"] = {(): 7}
    invalid([shard], "checkpoint key 's' slice ()", "expected an array, got int", key="s")


# --- TF's validate_shards checks ----------------------------------------------------------------


def test_duplicate_key_and_slice_across_shards():
    invalid([whole(), {"w": {W_TOP: block(W_TOP)}}], f"checkpoint key 'w' slice {W_TOP}", "shards 0 and 1", key="w")


def test_key_not_among_the_pieces():
    shard = whole()
    shard["ADDED_TENSOR_ABC123"] = {(): np.int32(1)}
    invalid([shard], "checkpoint key 'ADDED_TENSOR_ABC123'", "not among the pieces", key="ADDED_TENSOR_ABC123")


def test_altered_shape():
    shard = whole()
    shard["w"][W_TOP] = block(W_TOP).T
    invalid([shard], f"checkpoint key 'w' slice {W_TOP}", "altered shape", "(6, 2)", key="w")


def test_altered_dtype():
    shard = whole()
    shard["w"][W_TOP] = block(W_TOP).astype(np.int32)
    invalid([shard], f"checkpoint key 'w' slice {W_TOP}", "altered dtype", "int32", key="w")


def test_pieces_not_covered_lists_key_and_slice():
    shard = whole()
    del shard["w"][W_BOTTOM]
    del shard["s"]
    invalid(
        [shard], "not fully covered", f"checkpoint key 'w' slice {W_BOTTOM}", "checkpoint key 's' slice ()", key="w"
    )


def test_callback_returning_nothing_is_not_coverage():
    invalid([], "not fully covered", f"checkpoint key 'w' slice {W_TOP}", key="w")


# --- Our checks ---------------------------------------------------------------------------------


def test_slice_outside_the_leaf():
    spec = ((2, 5), (0, 6))
    shard = whole()
    shard["w"][spec] = np.zeros((3, 6), np.float32)
    invalid([shard], f"checkpoint key 'w' slice {spec}", "outside the leaf of shape (4, 6)", key="w")


def test_slice_not_within_one_piece():
    spec = ((1, 3), (0, 6))
    shard = {"w": {spec: block(spec)}, "s": {(): np.int32(7)}}
    invalid([shard], f"checkpoint key 'w' slice {spec}", "not within any one input piece", key="w")


def test_overlapping_slices():
    a, b = ((0, 2), (0, 4)), ((1, 2), (3, 6))
    shard = whole()
    shard["w"] = {a: block(a), b: block(b), W_BOTTOM: block(W_BOTTOM)}
    invalid([shard], "checkpoint key 'w'", f"slices {a} and {b} overlap", key="w")


def test_overlapping_slices_found_without_the_grid():
    a, b, c = ((0, 1), (0, 6)), ((1, 2), (0, 3)), ((0, 2), (2, 6))
    shard = whole()
    shard["w"] = {a: block(a), b: block(b), c: block(c), W_BOTTOM: block(W_BOTTOM)}
    invalid([shard], "checkpoint key 'w'", "overlap", key="w", max_grid_cells=1)


def test_partial_cover_found_without_the_grid():
    a, b = ((0, 1), (0, 6)), ((1, 2), (0, 5))
    shard = whole()
    shard["w"] = {a: block(a), b: block(b), W_BOTTOM: block(W_BOTTOM)}
    invalid([shard], "not fully covered", f"checkpoint key 'w' slice {W_TOP}", key="w", max_grid_cells=1)


def test_exact_cover_passes_without_the_grid():
    validate_shards(MaxShardSizePolicy(12)(pieces()), pieces(), DESCRIPTION, max_grid_cells=1)


def test_partial_cover_of_a_piece():
    spec = ((0, 2), (0, 5))
    shard = whole()
    shard["w"] = {spec: block(spec), W_BOTTOM: block(W_BOTTOM)}
    invalid([shard], "not fully covered", f"checkpoint key 'w' slice {W_TOP}", key="w")


def test_dropped_zero_size_piece_is_not_covered():
    empty = np.zeros((0,), np.float32)
    piece = ShardableTensor(empty, "e", ((0, 0),), (0,), empty.dtype)
    with pytest.raises(InvalidShardsError, match=re.escape("checkpoint key 'e' slice ((0, 0),)")):
        validate_shards([], [piece], DESCRIPTION)


def test_many_uncovered_pieces_are_summarised():
    many = [ShardableTensor(np.float32(i), f"k{i}", (), (), np.dtype(np.float32)) for i in range(8)]
    with pytest.raises(InvalidShardsError, match="and 3 more"):
        validate_shards([], many, DESCRIPTION)


@pytest.mark.parametrize(
    ("shape", "slices", "fragment"),
    [
        ((5,), [((0, 3),), ((2, 5),)], "slices ((0, 3),) and ((2, 5),) overlap"),
        ((5,), [((0, 2),), ((3, 5),)], "not fully covered"),
        ((2, 3, 4), [((0, 2), (0, 3), (0, 2)), ((1, 2), (2, 3), (1, 4))], "overlap"),
        ((2, 3, 4), [((0, 2), (0, 3), (0, 2)), ((0, 2), (0, 3), (2, 3))], "not fully covered"),
    ],
)
def test_exact_cover_in_rank_1_and_3(shape, slices, fragment):
    leaf = np.zeros(shape, np.int8)
    spec = tuple((0, n) for n in shape)
    shard = {"t": {s: block(s, leaf) for s in slices}}
    with pytest.raises(InvalidShardsError, match=re.escape(fragment)):
        validate_shards([shard], [ShardableTensor(leaf, "t", spec, shape, leaf.dtype)], DESCRIPTION)
