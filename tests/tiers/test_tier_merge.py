"""A local step's parts keep their indexes as binary rows, and process 0 merges them as the
leader's commit does (#24 item 2, #21): the same manifest and tables as the per-piece merge it
replaced, every disagreement refused, and a step of JSON indexes (an earlier tpu_ckpt's)
warned of and left to the persistent tier."""

import dataclasses
import os
import shutil

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import merge_indexes
from tpu_ckpt import storage
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import (
    IndexPlan,
    LeafEntry,
    Manifest,
    PieceEntry,
    TableSource,
    data_file_name,
    decode_index,
    decode_manifest,
    encode_index,
    encode_manifest,
    index_manifest,
    staged_index_file,
)
from tpu_ckpt.tiers._range_merge import blob_name, joined, leaf_ranges, merge_range, part_blobs

W = np.arange(32, dtype=np.float32).reshape(8, 4)


def _tree(step: int) -> dict:
    return {"w": W + step, "b": np.arange(3, dtype=np.int32) * step, "s": np.float32(step / 2), "step": step}


def _manager(tmp_path, keep=None) -> tc.CheckpointManager:
    return tc.CheckpointManager(
        str(tmp_path / "persistent"), save_interval_steps=100, local_directory=str(tmp_path / "local"),
        local_interval_steps=1, local_max_to_keep=keep,
    )


def _part(step_dir) -> tuple[IndexPlan, Manifest]:
    """A local step's plan, and its part 0's index in manifest form."""
    planned = decode_manifest((step_dir / "plan.json").read_bytes(), where="plan.json", tiled=False)
    plan = IndexPlan.of(planned)
    rows = decode_index((step_dir / "index-00000.bin").read_bytes(), where="index", plan=plan)
    return plan, index_manifest(rows, plan)


@pytest.fixture
def step(tmp_path):
    """A local step 3 (nothing persistent), and its directory."""
    with _manager(tmp_path) as m:
        m.save(3, _tree(3))  # a first save goes to both tiers: the persistent copy is dropped
    shutil.rmtree(tmp_path / "persistent" / "step_3")
    return tmp_path / "local" / "step_3"


def test_a_local_part_keeps_its_index_as_binary_rows_and_restores(tmp_path, step):
    assert [n for n in sorted(os.listdir(step)) if n.startswith("index-")] == ["index-00000.bin"]
    _, index = _part(step)
    assert {leaf.key for leaf in index.leaves} == {"w", "b", "s"}
    assert all((step / name).stat().st_size == size for name, size in index.files.items())
    with _manager(tmp_path) as m:
        restored = m.restore()
    assert restored["step"] == 3 and np.array_equal(restored["w"], W + 3) and restored["s"] == 1.5
    assert np.array_equal(restored["b"], np.arange(3) * 3)


def _w(index: Manifest, **change) -> Manifest:
    """``index`` with its first piece of ``w`` changed."""
    leaves = []
    for leaf in index.leaves:
        if leaf.key == "w":
            leaf = LeafEntry("w", [], "array", pieces=(leaf.pieces[0]._replace(**change), *leaf.pieces[1:]))
        leaves.append(leaf)
    return Manifest(tuple(leaves), index.files, 0, "")


@pytest.mark.parametrize(("change", "problem"), [
    ({"length": 64}, "a length other than the slice's bytes"),
    ({"slice": ((0, 8), (0, 2)), "length": 64}, "not of one save"),  # intact, but half of w: parts of other saves
    ({"slice": ((0, 80), (0, 4))}, "outside the leaf's shape"),
    ({"offset": 1 << 40}, "past the end of its data file"),
])
def test_a_resealed_binary_index_that_disagrees_is_refused(tmp_path, step, change, problem):
    plan, index = _part(step)
    (step / "index-00000.bin").write_bytes(encode_index(_w(index, **change), plan))  # a valid crc32c
    with _manager(tmp_path) as m:
        with pytest.raises(CorruptCheckpointError) as e:
            m.restore()
    assert "step_3" in str(e.value) and problem in str(e.value), e.value


def test_a_local_step_of_json_indexes_is_warned_of_restored_from_the_persistent_tier_and_pruned(tmp_path, caplog):
    with _manager(tmp_path) as m:
        m.save(1, _tree(1))  # both tiers
        m.save(2, _tree(2))  # local only
    old = tmp_path / "local" / "step_2"
    _, index = _part(old)
    (old / "index-00000.json").write_bytes(index.to_json())  # as an earlier tpu_ckpt left its part
    (old / "index-00000.bin").unlink()
    with _manager(tmp_path, keep=1) as m:
        assert m.latest_step() == 1
        restored = m.restore()
        assert restored["step"] == 1 and np.array_equal(restored["w"], W + 1)
        m.save(3, _tree(3))
    assert "earlier tpu_ckpt" in caplog.text and str(old) in caplog.text
    assert sorted(os.listdir(tmp_path / "local")) == ["step_3"]  # the old step went like any other


# -- merge_range alone, on synthetic parts ----------------------------------------------


def _leaf(key, shape):
    return LeafEntry(key, [["dict", key]], "array", tuple(shape), "float32")


PLANNED = Manifest(
    (
        _leaf("grid", (8, 6)), _leaf("cut", (4, 4)), _leaf("scalar", ()),
        LeafEntry("step", [["dict", "step"]], "value", value=7),
    ),
    {}, 3, "test callback",
)
SLICES = {
    "grid": [((a, a + 2), (b, b + 3)) for a in range(0, 8, 2) for b in (0, 3)],
    "cut": [((0, 2), (0, 4)), ((2, 4), (0, 1)), ((2, 4), (1, 4))],  # tiled, but no grid: kept inline
    "scalar": [()],
}


def _indexes(slices=SLICES) -> list[Manifest]:
    """Three parts: the pieces dealt out round robin, each part's in its one data file (an index
    is a manifest of the part's pieces and files)."""
    pieces: list[dict] = [{}, {}, {}]
    offsets = [0, 0, 0]
    for n, (key, spec) in enumerate((key, spec) for key, specs in slices.items() for spec in specs):
        p = n % 3
        length = 4 * int(np.prod([b - a for a, b in spec]))
        pieces[p].setdefault(key, []).append(PieceEntry(spec, data_file_name(p, 0), offsets[p], length, 100 + n))
        offsets[p] += length
    leaves = [tuple(LeafEntry(key, [], "array", pieces=tuple(got)) for key, got in own.items()) for own in pieces]
    return [Manifest(own, {data_file_name(p, 0): 4096}, 0, "") for p, own in enumerate(leaves)]


def _merge(indexes: list[Manifest]) -> tuple[bytes, dict[str, bytes]]:
    plan = IndexPlan.of(PLANNED)
    parts = [(staged_index_file(p), encode_index(one, plan)) for p, one in enumerate(indexes)]
    return merge_range(PLANNED.to_json(), parts, storage.location("/local/step_7"))


def test_merge_range_serves_the_manifest_and_tables_the_per_piece_merge_made():
    indexes = _indexes()
    assert _merge(indexes) == encode_manifest(merge_indexes(PLANNED, indexes))


def test_merge_range_refuses_parts_that_overlap_naming_the_leaf():
    overlapping = {**SLICES, "grid": [*SLICES["grid"][:-1], ((6, 8), (2, 6))]}
    with pytest.raises(CorruptCheckpointError, match=r"/local/step_7.*not of one save.*'grid'") as e:
        _merge(_indexes(overlapping))
    assert e.value.key == "grid"


# -- the merge spread over the job: each process a range of leaves ---------------------------


@pytest.mark.parametrize(("leaves", "processes"), [(4, 1), (4, 3), (4, 4), (4, 9), (2200, 1536), (1, 5)])
def test_leaf_ranges_cut_the_leaves_into_contiguous_ranges_one_per_process_at_most(leaves, processes):
    ranges = leaf_ranges(leaves, processes)
    assert len(ranges) == min(leaves, processes)
    assert ranges[0][0] == 0 and ranges[-1][1] == leaves
    assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("processes", [1, 2, 3, 4])
def test_ranges_merged_apart_and_joined_are_the_whole_merge(tmp_path, processes):
    """Each part's holder cuts its rows by range; each range merged alone names only the data
    files its rows use; joined, the ranges' manifests hold every leaf's pieces as the whole
    merge does."""
    plan = IndexPlan.of(PLANNED)
    for p, one in enumerate(_indexes()):
        (tmp_path / staged_index_file(p)).write_bytes(encode_index(one, plan))
    ranges = leaf_ranges(len(PLANNED.leaves), processes)
    with storage.Store(storage.location(str(tmp_path))) as own:
        blobs = part_blobs(own, [0, 1, 2], plan, ranges)
    assert sorted(blobs) == sorted(blob_name(p, r) for p in range(3) for r in range(len(ranges)))
    step = storage.location("/local/step_7")
    parts = []
    for r, leaves in enumerate(ranges):
        body, tables = merge_range(PLANNED.to_json(), [(blob_name(p, r), blobs[blob_name(p, r)]) for p in range(3)],
                                         step, leaves, table_prefix=f"r{r:05d}-")
        assert all(name.startswith(f"r{r:05d}-") for name in tables)
        part = decode_manifest(body, where="range", tables=_in_memory(tables))
        used = {piece.file for leaf in part.leaves if leaf.kind == "array" for piece in leaf.pieces}
        assert set(part.files) == used  # only the files its rows use
        parts.append(part)
    joined_manifest = joined(PLANNED, parts, ranges, "test")
    body, tables = _merge(_indexes())
    whole = decode_manifest(body, where="whole", tables=_in_memory(tables))
    assert [leaf.key for leaf in joined_manifest.leaves] == [leaf.key for leaf in PLANNED.leaves]
    for got, want in zip(joined_manifest.leaves, whole.leaves):
        assert sorted(got.pieces) == sorted(want.pieces), got.key


def _in_memory(tables: dict[str, bytes]) -> TableSource:
    return TableSource(lambda name, start, length: tables[name][start : start + length], lambda name: name)


def test_a_range_blob_holding_rows_of_another_range_is_refused(tmp_path):
    plan = IndexPlan.of(PLANNED)
    whole = [(staged_index_file(p), encode_index(one, plan)) for p, one in enumerate(_indexes())]
    with pytest.raises(CorruptCheckpointError, match=r"holds rows of leaf 0, outside the range 1\.\.3"):
        merge_range(PLANNED.to_json(), whole, storage.location("/local/step_7"), (1, 4))


def test_ranges_giving_one_data_file_two_sizes_are_refused():
    one = dataclasses.replace(PLANNED, leaves=PLANNED.leaves[:2], files={"d00000-00000.safetensors": 4096})
    two = dataclasses.replace(PLANNED, leaves=PLANNED.leaves[2:], files={"d00000-00000.safetensors": 4000})
    with pytest.raises(CorruptCheckpointError, match="different sizes"):
        joined(PLANNED, [one, two], [(0, 2), (2, 4)], "test")
