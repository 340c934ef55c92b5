"""Read planning: overlaps and coalescing, without IO."""

from tpu_ckpt import read_plan
from tpu_ckpt.format import LeafEntry, PieceEntry


def piece(slc, file="f", offset=0, length=16):
    return PieceEntry(slc, file, offset, length, 0)


def test_intersect():
    assert read_plan.intersect(((0, 4), (0, 4)), ((2, 6), (1, 2))) == ((2, 4), (1, 2))
    assert read_plan.intersect(((0, 4),), ((4, 8),)) is None
    assert read_plan.intersect((), ()) == ()


def test_overlapping_pieces():
    pieces = (piece(((0, 2), (0, 4))), piece(((2, 4), (0, 4)), offset=16))
    leaf = LeafEntry("w", [], "array", (4, 4), "float32", pieces=pieces)
    assert read_plan.overlapping(leaf, ((1, 3), (0, 1))) == list(pieces)
    assert read_plan.overlapping(leaf, ((2, 4), (0, 4))) == [pieces[1]]


def test_adjacent_pieces_coalesce_into_one_read_and_duplicates_are_read_once():
    a, b = piece(((0, 1),), offset=128), piece(((1, 2),), offset=144)
    c = piece(((2, 3),), offset=192)  # 32 bytes of alignment padding before it: same read
    e = piece(((3, 4),), offset=272)  # a 64-byte gap: a piece it does not need lies there
    d = piece(((0, 1),), file="g", offset=8)
    reads = read_plan.coalesce([("k", b), ("k", a), ("k", a), ("k", c), ("k", e), ("k", d)])
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
    reads = read_plan.coalesce(pieces)
    assert [len(r.pieces) for r in reads] == [1, 1, 1]


def test_empty_pieces_need_no_read():
    assert read_plan.coalesce([("k", piece(((0, 0),), length=0))]) == []
