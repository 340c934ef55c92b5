"""Read planning: overlaps and coalescing, without IO."""

from tpu_ckpt.format import LeafEntry, PieceEntry, coalesce, intersect, overlapping


def piece(slc, file="f", offset=0, length=16):
    return PieceEntry(slc, file, offset, length, 0)


def test_intersect():
    assert intersect(((0, 4), (0, 4)), ((2, 6), (1, 2))) == ((2, 4), (1, 2))
    assert intersect(((0, 4),), ((4, 8),)) is None
    assert intersect((), ()) == ()


def test_overlapping_pieces():
    pieces = (piece(((0, 2), (0, 4))), piece(((2, 4), (0, 4)), offset=16))
    leaf = LeafEntry("w", [], "array", (4, 4), "float32", pieces=pieces)
    assert overlapping(leaf, ((1, 3), (0, 1))) == list(pieces)
    assert overlapping(leaf, ((2, 4), (0, 4))) == [pieces[1]]


def test_adjacent_pieces_coalesce_into_one_read_and_duplicates_are_read_once():
    a, b = piece(((0, 1),), offset=128), piece(((1, 2),), offset=144)
    c = piece(((2, 3),), offset=192)  # 32 bytes of alignment padding before it: same read
    e = piece(((3, 4),), offset=272)  # a 64-byte gap: a piece it does not need lies there
    d = piece(((0, 1),), file="g", offset=8)
    reads = coalesce([("k", b), ("k", a), ("k", a), ("k", c), ("k", e), ("k", d)])
    assert [(r.file, r.start, r.stop, len(r.pieces)) for r in reads] == [
        ("f", 128, 208, 3), ("f", 272, 288, 1), ("g", 8, 24, 1),
    ]
    first = reads[0]
    assert first.lengths() == [16, 16, 32, 16]  # the padding is read too, as its own chunk
    chunks = [bytes([i]) * n for i, n in enumerate(first.lengths())]
    assert first.piece_chunks(chunks) == [chunks[0], chunks[1], chunks[3]]


def test_reads_are_capped_in_size():
    size = 40 << 20
    pieces = [("k", piece(((i, i + 1),), offset=i * size, length=size)) for i in range(3)]
    reads = coalesce(pieces)
    assert [len(r.pieces) for r in reads] == [1, 1, 1]


def test_empty_pieces_need_no_read():
    assert coalesce([("k", piece(((0, 0),), length=0))]) == []


def test_overlapping_matches_a_scan_of_every_piece():
    """The first-axis index returns exactly the pieces a full scan finds: grids, slabs cut
    along other axes (extents repeat), nested extents, zero-size pieces."""
    import random

    rng = random.Random(0)
    for case in range(300):
        rows, cols = rng.randint(1, 12), rng.randint(1, 12)
        if case % 3 == 0:  # a regular grid
            rs, cs = sorted(rng.sample(range(1, 40), rows - 1)), sorted(rng.sample(range(1, 40), cols - 1))
            row_cuts, col_cuts = list(zip([0, *rs], [*rs, 40])), list(zip([0, *cs], [*cs, 40]))
            boxes = [(r, c) for r in row_cuts for c in col_cuts]
        else:  # arbitrary boxes, overlapping extents included
            boxes = []
            for _ in range(rng.randint(1, 30)):
                a, b = sorted(rng.sample(range(41), 2)) if rng.random() > 0.1 else (7, 7)
                c, d = sorted(rng.sample(range(41), 2))
                boxes.append(((a, b), (c, d)))
        pieces = tuple(piece(s, offset=i * 64) for i, s in enumerate(dict.fromkeys(boxes)))
        leaf = LeafEntry("w", [], "array", (40, 40), "float32", pieces=pieces)
        for _ in range(20):
            a, b = sorted(rng.sample(range(41), 2))
            c, d = sorted(rng.sample(range(41), 2))
            want = ((a, b), (c, d))
            scan = [p for p in pieces if intersect(p.slice, want) is not None]
            assert sorted(overlapping(leaf, want), key=lambda p: p.offset) == sorted(scan, key=lambda p: p.offset)
