"""Format 2 planning with no files: a manifest encoded in memory, its piece tables held in a
dict. The rows a target needs are loaded first (IO, counted), then the plan is made from
them with no IO at all: its table source refuses any read."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import (
    ROW,
    LeafEntry,
    Manifest,
    PieceEntry,
    TableSource,
    decode_manifest,
    encode_manifest,
    load_rows,
)
from tpu_ckpt.restoring import _plan
from tpu_ckpt.restoring._plan import needed_slices

plan_restore = functools.partial(_plan.plan_restore, batch_bytes=1 << 20)
FILE = "d00000-00000.safetensors"


def _grid_leaf(key: str, shape: tuple[int, int], rows: int, cols: int) -> LeafEntry:
    """A float32 leaf cut into a rows x cols grid, its pieces back to back in one data file."""
    h, w = shape[0] // rows, shape[1] // cols
    pieces = [
        PieceEntry(
            ((r * h, (r + 1) * h), (c * w, (c + 1) * w)), FILE, 4 * h * w * (r * cols + c), 4 * h * w, r * cols + c
        )
        for r in range(rows) for c in range(cols)
    ]
    return LeafEntry(key, [("dict", key)], "array", shape, "float32", False, None, tuple(pieces))


class _Tables:
    """Piece tables in memory; every read recorded, and refused while ``closed``."""

    def __init__(self, tables: dict[str, bytes]):
        self.tables, self.reads, self.closed = tables, [], False

    def read(self, name: str, start: int, length: int) -> bytes:
        if self.closed:
            raise AssertionError(f"planning read {name}[{start}:{start + length}]")
        self.reads.append((start // ROW.itemsize, length // ROW.itemsize))
        return self.tables[name][start : start + length]


def _decoded(*leaves: LeafEntry) -> tuple[Manifest, _Tables]:
    saved = Manifest(tuple(leaves), {FILE: sum(p.length for leaf in leaves for p in leaf.pieces)}, 1, "test")
    body, tables = encode_manifest(saved)
    source = _Tables(tables)
    return decode_manifest(body, where="memory", tables=TableSource(source.read, lambda name: name)), source


def test_a_plan_is_made_from_the_loaded_rows_alone(mesh24):
    manifest, tables = _decoded(_grid_leaf("w", (8, 8), 4, 2), _grid_leaf("b", (8, 8), 8, 1))
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh24, P("data", "model")))}
    load_rows(needed_slices(manifest, target, None, False), threads=1)
    assert tables.reads == [(0, 8)]  # w's 8 rows in one read; b (not in the target) untouched
    tables.closed = True
    (entry,) = plan_restore(manifest, target).leaves
    by_region = {r.slice: sorted(p.slice for p in r.pieces) for r in entry.regions}
    assert by_region[((0, 4), (0, 2))] == [((0, 2), (0, 4)), ((2, 4), (0, 4))]
    assert plan_restore(manifest, target) == plan_restore(manifest, target)


def test_planning_does_no_io_of_its_own():
    """Rows not loaded are the caller's error, never a read behind its back."""
    manifest, tables = _decoded(_grid_leaf("w", (8, 8), 4, 2))
    tables.closed = True
    with pytest.raises(CheckpointError, match="'w'.*not loaded"):
        plan_restore(manifest, None)


def test_a_part_of_a_leaf_loads_the_rows_of_its_cells_only():
    """A quarter of a 16 x 4 grid: rows of the cells holding it, in runs (each run reads at
    most twice its own rows), and a piece entry for each of those cells only."""
    manifest, tables = _decoded(_grid_leaf("w", (64, 16), 16, 4))
    (leaf,) = manifest.leaves
    quarter = ((0, 16), (0, 8))  # grid rows 0-3, columns 0-1: cells 0, 1, 4, 5, 8, 9, 12, 13
    load_rows([(leaf, [quarter])], threads=1)
    assert sum(count for _, count in tables.reads) <= 2 * 8
    assert len(leaf.pieces.so_far()) == 8
    tables.closed = True
    pieces = leaf.pieces.overlapping(quarter)
    assert sorted(p.slice for p in pieces) == [((r, r + 4), (c, c + 4)) for r in range(0, 16, 4) for c in (0, 4)]
    assert all(p.crc32c == (p.slice[0][0] // 4) * 4 + p.slice[1][0] // 4 for p in pieces)  # each row's own fields
    with pytest.raises(CheckpointError, match="not loaded"):
        leaf.pieces.overlapping(((16, 17), (0, 1)))


def test_rows_loaded_by_the_cell_are_checked_row_by_row():
    """A part of a leaf cannot be checked against the leaf's crc32c (it covers every row), so
    each row is: a file index past the manifest's files is refused, naming the key."""
    leaf = _grid_leaf("w", (64, 16), 16, 4)
    manifest, tables = _decoded(leaf)
    (name,) = tables.tables
    data = bytearray(tables.tables[name])
    data[ROW.itemsize * 5 + 8] = 7  # cell 5's file index
    tables.tables[name] = bytes(data)
    with pytest.raises(CorruptCheckpointError, match="file index") as e:
        load_rows([(manifest.leaves[0], [((0, 16), (0, 8))])], threads=1)
    assert e.value.key == "w"
