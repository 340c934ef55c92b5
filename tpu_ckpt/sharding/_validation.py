"""Checks a sharding callback's result before a single byte is written.

TensorFlow 2.21 defines ``validate_shards`` but never calls it, so a callback that drops or
reshapes a tensor writes a "successful" checkpoint that cannot be restored. We run the same
checks on every save, plus the ones TF cannot express with slice-spec strings: slices must lie
inside one piece, must not overlap, and must cover every piece exactly.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt.errors import InvalidShardsError
from tpu_ckpt.format import MAX_GRID_CELLS, SliceSpec, contains, cover
from tpu_ckpt.sharding._pieces import ShardableTensor

_MAX_LISTED = 5
"""How many uncovered pieces an error lists by name."""


@dataclasses.dataclass
class _Leaf:
    """What the input pieces say about one checkpoint key."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: dict[SliceSpec, list[SliceSpec]]  # piece slice -> output slices placed inside it


def validate_shards(
    shards: Any,
    shardable_tensors: Sequence[ShardableTensor],
    description: str,
    *,
    max_grid_cells: int = MAX_GRID_CELLS,
) -> None:
    """Raises ``InvalidShardsError`` unless ``shards`` covers every piece exactly once, each
    slice with its shape and dtype (the values are not compared: that would read them all).

    Empty shards are allowed (the caller drops them).
    """
    _Validator(description, shardable_tensors, max_grid_cells).run(shards)


class _Validator:
    """One validation: the leaves the pieces describe, and the output slices filed under each piece."""

    def __init__(self, description: str, shardable_tensors: Sequence[ShardableTensor], max_grid_cells: int):
        self.description = description
        self.max_grid_cells = max_grid_cells
        self.leaves: dict[str, _Leaf] = {}
        for piece in shardable_tensors:
            leaf = self.leaves.setdefault(piece.checkpoint_key, _Leaf(tuple(piece.shape), np.dtype(piece.dtype), {}))
            leaf.pieces.setdefault(tuple(piece.slice_spec), [])

    def error(self, problem: str, key: str | None = None) -> InvalidShardsError:
        return InvalidShardsError(
            f"Sharding callback '{self.description}' returned an invalid result: {problem}", key=key
        )

    def run(self, shards: Any) -> None:
        if not isinstance(shards, (list, tuple)):
            raise self.error(f"expected a list of shards, got {type(shards).__name__}")
        seen: dict[tuple[str, SliceSpec], int] = {}
        for index, shard in enumerate(shards):
            if not isinstance(shard, Mapping):
                raise self.error(f"shard {index} is a {type(shard).__name__}, expected a dict of dicts")
            for key, entries in shard.items():
                if not isinstance(entries, Mapping):
                    raise self.error(
                        f"shard {index}, checkpoint key {key!r}: expected a dict {{slice_spec: array}}, "
                        f"got {type(entries).__name__}",
                        key=_key_or_none(key),
                    )
                for raw_spec, array in entries.items():
                    spec = self.check_entry(key, raw_spec, array)
                    if (key, spec) in seen:
                        raise self.error(
                            f"checkpoint key {key!r} slice {spec} appears in shards {seen[key, spec]} and {index}",
                            key=key,
                        )
                    seen[key, spec] = index
        self.check_coverage()

    def check_entry(self, key: Any, raw_spec: Any, array: Any) -> SliceSpec:
        """Checks one ``{key: {slice_spec: array}}`` entry; files it under its piece; returns the slice."""
        leaf = self.leaves.get(key)
        if leaf is None:
            raise self.error(
                f"checkpoint key {key!r} (slice {raw_spec!r}) is not among the pieces given to the callback",
                key=_key_or_none(key),
            )
        if isinstance(raw_spec, tuple) and raw_spec in leaf.pieces and _plain_ints(raw_spec):  # a whole piece
            self.check_array(key, raw_spec, array, leaf)
            leaf.pieces[raw_spec].append(raw_spec)
            return raw_spec
        spec = _as_slice_spec(raw_spec, len(leaf.shape))
        where = f"checkpoint key {key!r} slice {spec if spec is not None else repr(raw_spec)}"
        if spec is None:
            raise self.error(
                f"{where}: a slice spec must be a tuple of {len(leaf.shape)} (start, stop) int pairs", key=key
            )
        if not all(0 <= a <= b <= n for (a, b), n in zip(spec, leaf.shape)):
            raise self.error(f"{where} lies outside the leaf of shape {leaf.shape}", key=key)
        piece = _containing_piece(spec, leaf.pieces)
        if piece is None:
            raise self.error(
                f"{where} is not within any one input piece of that key (pieces: {list(leaf.pieces)})", key=key
            )
        self.check_array(key, spec, array, leaf)
        leaf.pieces[piece].append(spec)
        return spec

    def check_array(self, key: str, spec: SliceSpec, array: Any, leaf: _Leaf) -> None:
        """The array must be the block itself: same extent, same dtype, on this process."""
        where = _Where(key, spec)
        if not (hasattr(array, "shape") and hasattr(array, "dtype")):
            raise self.error(f"{where}: expected an array, got {type(array).__name__}", key=key)
        extent = tuple(b - a for a, b in spec)
        if tuple(array.shape) != extent:
            raise self.error(
                f"{where}: altered shape: the array has shape {tuple(array.shape)}, the slice spans {extent}",
                key=key,
            )
        if np.dtype(array.dtype) != leaf.dtype:
            raise self.error(f"{where}: altered dtype: {np.dtype(array.dtype)} instead of {leaf.dtype}", key=key)
        if isinstance(array, jax.Array) and not array.is_fully_addressable:
            raise self.error(f"{where}: altered task: the array is not fully addressable by this process", key=key)

    def check_coverage(self) -> None:
        """Every piece must be covered by the slices filed under it, with no overlap."""
        uncovered: list[tuple[str, SliceSpec]] = []
        for key, leaf in self.leaves.items():
            for piece, filed in leaf.pieces.items():
                overlap, missing = cover(piece, filed, self.max_grid_cells)
                if overlap is not None:
                    raise self.error(f"checkpoint key {key!r}: slices {overlap[0]} and {overlap[1]} overlap", key=key)
                if missing:
                    uncovered.append((key, piece))
        if uncovered:
            listed = ", ".join(f"checkpoint key {key!r} slice {piece}" for key, piece in uncovered[:_MAX_LISTED])
            more = f" and {len(uncovered) - _MAX_LISTED} more" if len(uncovered) > _MAX_LISTED else ""
            raise self.error(f"pieces not fully covered by the shards: {listed}{more}", key=uncovered[0][0])


@dataclasses.dataclass(frozen=True)
class _Where:
    """Formats "checkpoint key ... slice ..." only when an error message needs it."""

    key: str
    spec: SliceSpec

    def __str__(self) -> str:
        return f"checkpoint key {self.key!r} slice {self.spec}"


def _plain_ints(spec: tuple) -> bool:
    """Whether an (already piece-equal) spec is made of ints, not merely of numbers equal to them."""
    return all(type(a) is int and type(b) is int for a, b in spec)


def _key_or_none(key: Any) -> str | None:
    return key if isinstance(key, str) else None


def _as_slice_spec(spec: Any, rank: int) -> SliceSpec | None:
    """``spec`` with plain-int bounds, or ``None`` unless it is ``rank`` (start, stop) int pairs."""
    if not isinstance(spec, tuple) or len(spec) != rank:
        return None
    out = []
    for pair in spec:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(map(_is_int, pair))):
            return None
        out.append((int(pair[0]), int(pair[1])))
    return tuple(out)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _containing_piece(spec: SliceSpec, pieces: Mapping[SliceSpec, Any]) -> SliceSpec | None:
    """The input piece that holds ``spec`` (pieces of one leaf are disjoint, as LocalPieces.add makes them)."""
    if spec in pieces:
        return spec
    return next((piece for piece in pieces if contains(piece, spec)), None)
