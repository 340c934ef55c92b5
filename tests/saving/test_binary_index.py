"""The leader's merge of binary indexes (#21): the same manifest and tables as the merge of
manifest-form indexes, and every inconsistency refused, without a Python object per piece."""

import pytest

import tpu_ckpt as tc
from tests.support.helpers import binary_merge, merge_indexes
from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import (
    IndexPlan,
    LeafEntry,
    Manifest,
    PieceEntry,
    decode_index,
    decode_manifest,
    encode_index,
    encode_manifest,
    encode_parts,
    piece_rows,
    staged_index_file,
    written_by,
)
from tpu_ckpt.saving import merge_rows
from tpu_ckpt.saving._commit import commit, index

FILE_BYTES = 1 << 20


def _leaf(key, shape, dtype="float32"):
    return LeafEntry(key, [["dict", key]], "array", tuple(shape), dtype)


PLANNED = Manifest(
    (
        _leaf("grid2d", (8, 6)),
        _leaf("uneven", (8,), "int16"),
        _leaf("scalar", ()),
        LeafEntry("step", [["dict", "step"]], "value", value=3),
        _leaf("cut", (4, 4)),  # cut unevenly: a valid tiling, but no grid (stays inline)
        _leaf("empty", (0, 3)),
    ),
    {}, 3, "test callback",
)
ITEMSIZE = {"grid2d": 4, "uneven": 2, "scalar": 4, "cut": 4, "empty": 4}


def _slices(key):
    if key == "grid2d":
        return [((a, a + 2), (b, b + 3)) for a in range(0, 8, 2) for b in (0, 3)]
    if key == "uneven":
        return [((0, 3),), ((3, 5),), ((5, 8),)]
    if key == "scalar":
        return [()]
    if key == "cut":
        return [((0, 2), (0, 4)), ((2, 4), (0, 1)), ((2, 4), (1, 4))]
    return [((0, 0), (0, 3))]


def _indexes(slices_of=_slices, processes=3):
    """Each process's index: the pieces of every leaf dealt out round robin, laid out in its
    one data file in the order it got them."""
    pieces = [{} for _ in range(processes)]
    offsets = [0] * processes
    n = 0
    for key in ITEMSIZE:
        for spec in slices_of(key):
            p = n % processes
            n += 1
            length = ITEMSIZE[key]
            for a, b in spec:
                length *= b - a
            pieces[p].setdefault(key, []).append(
                PieceEntry(spec, f"d{p:05d}-00000.safetensors", offsets[p], length, 1000 + n if length else 0)
            )
            offsets[p] += length + 64
    return [index(own, {f"d{p:05d}-00000.safetensors": FILE_BYTES}) for p, own in enumerate(pieces)]


def _binary_merge(indexes, planned=PLANNED):
    return binary_merge(planned, indexes)


def test_binary_merge_commits_the_same_manifest_and_tables_as_the_manifest_form_merge():
    indexes = _indexes()
    before = encode_manifest(merge_indexes(PLANNED, indexes))
    merged, grids = _binary_merge(indexes)
    assert [g is not None for g in grids] == [True, True, True, False, False, False]  # cut and empty stay inline
    assert encode_manifest(merged, grids) == before
    assert list(grids) == [None] * 6  # each leaf's rows let go of once in its table (#39)
    decoded = decode_manifest(before[0], where="manifest.json", tables=None)
    assert [p.slice for p in decoded.leaves[4].pieces] == sorted(_slices("cut"))


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda key, s: s + s[:1] if key == "grid2d" else s, "listed more than once"),  # a duplicate
        (lambda key, s: s[1:] if key == "uneven" else s, "gap"),
        (lambda key, s: [((0, 4),), ((2, 8),)] if key == "uneven" else s, "overlap"),
        (lambda key, s: [] if key == "scalar" else s, "no block"),
    ],
    ids=["duplicate", "gap", "overlap", "missing"],
)
def test_binary_merge_refuses_pieces_that_do_not_tile_their_leaf(change, problem):
    indexes = _indexes(lambda key: change(key, _slices(key)))
    with pytest.raises(tc.CheckpointError, match=f"{problem}.*refusing to commit"):
        _binary_merge(indexes)
    with pytest.raises(tc.CheckpointError, match=problem):  # what the manifest-form merge said
        merge_indexes(PLANNED, indexes)


def test_two_processes_claiming_one_data_file_are_refused():
    indexes = _indexes()
    twin = index({"grid2d": []}, dict(indexes[0].files))
    with pytest.raises(tc.CorruptCheckpointError, match="both claim data file d00000-00000.safetensors"):
        _binary_merge([*indexes, twin])


def test_commit_reads_and_deletes_the_binary_indexes_and_writes_the_same_manifest(tmp_path):
    indexes = _indexes()
    staging, final = tmp_path / "ckpt.tmp-1", tmp_path / "ckpt"
    staging.mkdir()
    plan = IndexPlan.of(PLANNED)
    for p, one in enumerate(indexes):
        (staging / f"d{p:05d}-00000.safetensors").write_bytes(b"\0" * FILE_BYTES)
        if p:
            (staging / staged_index_file(p)).write_bytes(encode_index(one, plan))
    with storage.Store(storage.location(str(staging))) as store:
        commit(store, storage.location(str(final)), PLANNED, indexes[0], [1, 2])
    body, tables = encode_manifest(merge_indexes(PLANNED, indexes))
    assert (final / "manifest.json").read_bytes() == body
    assert {name: (final / name).read_bytes() for name in tables} == tables
    assert not [f for f in final.iterdir() if f.name.startswith("index-")]


def test_commit_names_a_missing_index(tmp_path):
    staging = tmp_path / "ckpt.tmp-1"
    staging.mkdir()
    with storage.Store(storage.location(str(staging))) as store, pytest.raises(tc.CorruptCheckpointError) as caught:
        commit(store, storage.location(str(tmp_path / "ckpt")), PLANNED, _indexes()[0], [1])
    assert "index-00001.bin" in str(caught.value) and caught.value.file.endswith("index-00001.bin")


def _random_layout(rng):
    """A random leaf and a grid of pieces over it, maybe damaged: a piece dropped, repeated,
    moved, grown or cut in two."""
    rank = int(rng.integers(1, 4))
    shape = tuple(int(n) for n in rng.integers(1, 7, rank))
    cuts = [sorted({0, n, *(rng.integers(1, n, int(rng.integers(0, n))).tolist() if n > 1 else [])}) for n in shape]
    specs = [()]
    for axis in cuts:
        specs = [s + ((a, b),) for s in specs for a, b in zip(axis, axis[1:])]
    damage = int(rng.integers(0, 6))
    i = int(rng.integers(0, len(specs)))
    if damage == 1:
        specs.pop(i)
    elif damage == 2:
        specs.append(specs[i])
    elif damage in (3, 4):
        d = int(rng.integers(0, rank))
        a, b = specs[i][d]
        moved = (max(a - 1, 0), b) if damage == 3 else (a, b + 1 if b < shape[d] else b)
        specs[i] = specs[i][:d] + (moved,) + specs[i][d + 1 :]
    elif damage == 5:
        d = int(rng.integers(0, rank))
        a, b = specs[i][d]
        if b - a > 1:
            specs[i : i + 1] = [
                specs[i][:d] + ((a, a + 1),) + specs[i][d + 1 :], specs[i][:d] + ((a + 1, b),) + specs[i][d + 1 :]
            ]
    return shape, specs


def test_the_vectorised_grid_check_agrees_with_the_per_piece_one_on_random_layouts():
    import numpy as np

    rng = np.random.default_rng(21)
    for _ in range(300):
        shape, specs = _random_layout(rng)
        planned = Manifest((_leaf("x", shape, "int8"),), {}, 2, "x")
        pieces, ends = [[], []], [0, 0]
        for n, spec in enumerate(specs):
            length = 1
            for a, b in spec:
                length *= b - a
            pieces[n % 2].append(
                PieceEntry(spec, f"d{n % 2:05d}-00000.safetensors", ends[n % 2], length, 5 if length else 0)
            )
            ends[n % 2] += length
        indexes = [index({"x": p}, {f"d{q:05d}-00000.safetensors": ends[q]}) for q, p in enumerate(pieces)]
        try:
            expected = encode_manifest(merge_indexes(planned, indexes))
        except tc.CheckpointError as error:
            with pytest.raises(tc.CheckpointError) as caught:
                _binary_merge(indexes, planned)
            assert str(caught.value) == str(error), (shape, specs)
            continue
        merged, grids = _binary_merge(indexes, planned)
        assert encode_manifest(merged, grids) == expected, (shape, specs)


def test_an_index_with_empty_groups_or_no_rows_merges():
    plan = IndexPlan.of(PLANNED)
    rows = [decode_index(encode_index(one, plan), where=str(p), plan=plan) for p, one in enumerate(_indexes())]
    nothing = index({}, {"d00009-00000.safetensors": 0})
    empty = decode_index(encode_index(nothing, plan), where="empty", plan=plan)
    empty.groups[2] = rows[0].groups[2][:0]  # a group of no rows
    merged, grids = merge_rows(PLANNED, plan, [*rows, empty])
    assert encode_manifest(merged, grids) == encode_manifest(merge_indexes(PLANNED, [*_indexes(), nothing]))


def test_a_staged_index_is_named_for_its_process():
    assert staged_index_file(7) == "index-00007.bin" and written_by("index-00007.bin") == 7  # the relay accepts it


def test_index_rows_made_a_file_at_a_time_encode_as_the_manifest_form_does():
    """#39: a save keeps its index as rows made as each data file is laid out (piece_rows), not
    an object per piece: encoded, the same bytes as its manifest form, whatever the order the
    rows came in; a key outside the plan is refused by name."""
    plan = IndexPlan.of(PLANNED)
    for own in _indexes():
        names = list(own.files)
        one_by_one = [
            piece_rows(plan, names.index(p.file), [leaf.key], [p])
            for leaf in reversed(own.leaves) for p in reversed(leaf.pieces)
        ]
        assert encode_parts(plan, list(own.files.items()), one_by_one) == encode_index(own, plan)
    with pytest.raises(CheckpointError, match="'nowhere' was written but is not in the planned tree"):
        piece_rows(plan, 0, ["nowhere"], [PieceEntry((), "f", 0, 4, 0)])
