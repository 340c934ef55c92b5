"""Slice arithmetic: the one home for how blocks of an array relate to each other.

A slice is one ``(start, stop)`` pair per dimension (``()`` for a scalar). Saving checks that
a sharding callback's blocks cover each piece exactly; committing and reading a manifest
check that a leaf's pieces tile it exactly; restoring intersects pieces with the regions a
device needs. All of it is here, with no JAX, so the command line and the manifest reader
can use it too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from collections.abc import Iterator, Sequence

import numpy as np

SliceSpec = tuple[tuple[int, int], ...]
"""Where a block sits in its global array: one ``(start, stop)`` pair per dimension."""

MAX_GRID_CELLS = 1 << 20
"""Above this many cells an exact-cover check sweeps slices instead of counting on a grid."""

Overlap = tuple[SliceSpec, SliceSpec]


def volume(spec: SliceSpec) -> int:
    """The number of elements in a slice."""
    return math.prod(b - a for a, b in spec)


def extent(spec: SliceSpec) -> tuple[int, ...]:
    """The shape of the block a slice describes."""
    return tuple(b - a for a, b in spec)


def full_slice(shape: Sequence[int]) -> SliceSpec:
    """The slice holding a whole array of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def contains(outer: SliceSpec, inner: SliceSpec) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def intersect(a: SliceSpec, b: SliceSpec) -> SliceSpec | None:
    """The overlap of two slices, or None when they are disjoint (empty slices never overlap)."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(region: SliceSpec, within: SliceSpec) -> tuple[slice, ...]:
    """``region`` as an index into the array holding ``within`` (which contains it)."""
    return tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(region, within))


Grid = tuple[list[list[int]], list[int]]
"""A leaf's cut points per axis, and each block's cell in C order (see :func:`grid`)."""


_SCOPE = threading.local()


@contextlib.contextmanager
def grids_shared() -> Iterator[None]:
    """Within it, on this thread, :func:`grid` works out each (shape, slices) once: a commit
    asks for each leaf's grid twice (its tiling check, then its piece table), and a model's
    leaves come in a few layouts, so a pod's million pieces are gridded once per layout
    rather than twice per leaf. Nothing is kept past the block."""
    if getattr(_SCOPE, "grids", None) is not None:
        yield
        return
    _SCOPE.grids = {}
    try:
        yield
    finally:
        _SCOPE.grids = None


def grid(shape: tuple[int, ...], slices: tuple[SliceSpec, ...]) -> Grid | None:
    """The cut points per axis and each block's cell (C order) when ``slices`` are exactly
    the cells of a grid over ``shape``, which proves they tile it; None otherwise. Within
    :func:`grids_shared` the answer is shared, not to be changed."""
    grids = getattr(_SCOPE, "grids", None)
    if grids is None:
        return _grid(shape, slices)
    key = (shape, slices)
    if key not in grids:
        grids[key] = _grid(shape, slices)
    return grids[key]


def _grid(shape: tuple[int, ...], slices: tuple[SliceSpec, ...]) -> Grid | None:
    rank = len(shape)
    if not slices or 0 in shape or any(len(s) != rank for s in slices):
        return None
    cuts = [sorted({x for s in slices for x in s[d]}) for d in range(rank)]
    if any(c[0] != 0 or c[-1] != n for c, n in zip(cuts, shape)):
        return None
    where = [{c: i for i, c in enumerate(axis)} for axis in cuts]
    counts = [len(c) - 1 for c in cuts]
    if len(slices) != math.prod(counts):
        return None
    cells = []
    for spec in slices:
        cell = 0
        for d, (a, b) in enumerate(spec):
            i = where[d][a]
            if where[d][b] != i + 1:
                return None
            cell = cell * counts[d] + i
        cells.append(cell)
    if len(set(cells)) != len(cells):
        return None
    return cuts, cells


def tiling_problem(
    shape: Sequence[int], slices: Sequence[SliceSpec], max_grid_cells: int = MAX_GRID_CELLS
) -> str | None:
    """Why ``slices`` do not tile an array of ``shape`` exactly (a gap, an overlap, a block
    outside the array), or None when they do.

    O(pieces) for the layouts sharding produces (a grid of blocks: :func:`grid`); other
    layouts fall back to :func:`cover`. Blocks holding no element are allowed anywhere
    inside the array.
    """
    if grid(tuple(shape), tuple(slices)) is not None:
        return None
    for spec in slices:
        if len(spec) != len(shape) or not all(0 <= a <= b <= n for (a, b), n in zip(spec, shape)):
            return f"block {list(spec)} does not lie inside shape {list(shape)}"
    if len(set(slices)) != len(slices):
        return "a block is listed more than once"
    blocks = [s for s in slices if volume(s) > 0]
    total = math.prod(shape)
    if total == 0 or not shape:
        return None if (blocks or total == 0) else "the scalar has no block"
    if _is_grid(shape, blocks):
        return None
    overlap, missing = cover(full_slice(shape), blocks, max_grid_cells)
    if overlap is not None:
        return f"blocks {list(overlap[0])} and {list(overlap[1])} overlap"
    if missing:
        covered = sum(map(volume, blocks))
        return f"the blocks cover {covered} of its {total} elements, leaving a gap"
    return None


def _is_grid(shape: Sequence[int], blocks: Sequence[SliceSpec]) -> bool:
    """Whether distinct ``blocks`` are exactly the cells of a grid partitioning the array.

    Per dimension, the distinct intervals must partition ``[0, n)``; then distinct blocks
    drawn from those intervals, as many as the grid has cells, are every cell once.
    """
    if not blocks:  # no piece at all (e.g. a leaf no process wrote): not a grid, a gap
        return False
    cells = 1
    for d, n in enumerate(shape):
        intervals = sorted({spec[d] for spec in blocks})
        if intervals[0][0] != 0 or intervals[-1][1] != n:
            return False
        if any(a[1] != b[0] for a, b in zip(intervals, intervals[1:])):
            return False
        cells *= len(intervals)
    return cells == len(blocks)


def cover(
    piece: SliceSpec, slices: Sequence[SliceSpec], max_grid_cells: int = MAX_GRID_CELLS
) -> tuple[Overlap | None, bool]:
    """``(two overlapping slices or None, whether part of piece is left uncovered)``.

    All ``slices`` lie inside ``piece`` and are distinct, so a scalar piece is covered exactly
    when any slice was filed under it. So is an empty piece.
    """
    slices = list(slices)
    if not slices:
        return None, True
    if not piece or volume(piece) == 0 or slices == [piece]:  # the common case: the piece, whole
        return None, False
    boxes = np.array(slices, dtype=np.int64).reshape(len(slices), len(piece), 2)
    bounds = [np.unique(np.concatenate([piece[d], boxes[:, d].ravel()])) for d in range(len(piece))]
    if math.prod(len(b) - 1 for b in bounds) <= max_grid_cells:
        return _cover_on_grid(bounds, boxes, slices)
    overlap = _first_overlap(slices)
    return overlap, overlap is None and sum(map(volume, slices)) != volume(piece)


def _cover_on_grid(bounds: list[np.ndarray], boxes: np.ndarray, slices: list[SliceSpec]) -> tuple[Overlap | None, bool]:
    """Counts how often each cell between consecutive slice boundaries is covered (coordinate compression).

    Each box adds +-1 at its 2**rank corners of a difference array, whose running sums along
    every axis are the counts, so the work is vectorised over all boxes at once.
    """
    rank = len(bounds)
    lo = np.stack([np.searchsorted(b, boxes[:, d, 0]) for d, b in enumerate(bounds)], axis=1)
    hi = np.stack([np.searchsorted(b, boxes[:, d, 1]) for d, b in enumerate(bounds)], axis=1)
    counts = np.zeros([len(b) for b in bounds], dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=rank):
        index = tuple(hi[:, d] if upper else lo[:, d] for d, upper in enumerate(corner))
        np.add.at(counts, index, (-1) ** sum(corner))
    for d in range(rank):
        counts = np.cumsum(counts, axis=d)
    counts = counts[(slice(0, -1),) * rank]
    doubled = np.argwhere(counts > 1)
    if len(doubled):
        point = np.array([b[i] for b, i in zip(bounds, doubled[0])])
        inside = np.all((boxes[:, :, 0] <= point) & (point < boxes[:, :, 1]), axis=1)
        first, second = np.flatnonzero(inside)[:2]
        return (slices[first], slices[second]), False
    return None, bool((counts == 0).any())


def _first_overlap(slices: list[SliceSpec]) -> Overlap | None:
    """Two overlapping non-empty slices, by a sweep along the axis with the most distinct starts."""
    boxes = [s for s in slices if volume(s) > 0]
    axis = max(range(len(boxes[0])), key=lambda d: len({s[d][0] for s in boxes})) if boxes else 0
    active: list[SliceSpec] = []
    for box in sorted(boxes, key=lambda s: s[axis][0]):
        active = [other for other in active if other[axis][1] > box[axis][0]]
        hit = next((other for other in active if intersect(other, box) is not None), None)
        if hit is not None:
            return hit, box
        active.append(box)
    return None
