"""Grids of slices: shared within a commit, kept by nothing after it."""

import numpy as np

import tpu_ckpt as tc
from tpu_ckpt.format import _slices as slices


def test_grids_are_shared_within_a_commit_and_kept_by_nothing_after(tmp_path):
    """A commit grids each layout once (its tiling check's grids serve the piece table),
    and no grid outlives it: a long-lived cache would pin a big manifest's slices."""
    shape, cells = (8, 4), tuple(((r, r + 2), (0, 4)) for r in range(0, 8, 2))
    with slices.grids_shared():
        assert slices.grid(shape, cells) is slices.grid(shape, tuple(list(cells)))
    assert slices.grid(shape, cells) is not slices.grid(shape, cells)  # outside: worked out anew
    assert slices.grid(shape, cells) == ([[0, 2, 4, 6, 8], [0, 4]], [0, 1, 2, 3])
    tc.save(tmp_path / "c", {"a": np.ones((8, 4)), "b": np.zeros(3)}).wait()
    assert slices._SCOPE.grids is None
