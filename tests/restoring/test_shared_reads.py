"""load_and_broadcast's cache of pieces read for peers, against a real store on disk."""

import numpy as np

import tpu_ckpt as tc
from tpu_ckpt import storage
from tpu_ckpt.catalog import read_manifest
from tpu_ckpt.restoring._shared_reads import _ReadOnce


def _pieces(tmp_path, count: int):
    """A checkpoint of ``count`` 1 MiB leaves; each piece's id, and the piece."""
    tc.save(tmp_path / "c", {f"k{i}": np.full(1 << 18, i, np.float32) for i in range(count)})
    manifest = read_manifest(storage.location(tmp_path / "c"))
    return {(p.file, p.offset): (leaf.key, p) for leaf in manifest.leaves for p in leaf.pieces}


def test_pieces_beyond_the_limit_are_dropped_and_read_again_when_asked(tmp_path):
    """Two peers need every piece; peer 1 asks for all of them first. With keep_bytes of two
    pieces the cache never holds more than two, and peer 2 still gets every piece, exact
    (read again), where an unbounded cache would have held them all."""
    pieces = _pieces(tmp_path, 6)
    needers = {pid: frozenset({1, 2}) for pid in pieces}
    with storage.Store(storage.location(tmp_path / "c")) as store:
        def fetch(key, piece):
            return store.read(piece.file, piece.offset, [piece.length])

        bounded = _ReadOnce(fetch, pieces, needers, 2 << 20, store.location)
        unbounded = _ReadOnce(fetch, pieces, needers, None, store.location)
        for pid in pieces:
            bounded.take(*pid, process=1).result()
            unbounded.take(*pid, process=1)
            assert bounded._held_bytes <= 2 << 20
        assert unbounded._held_bytes == 6 << 20
        for pid, (key, _) in pieces.items():
            (chunk,) = bounded.take(*pid, process=2).result()
            assert np.array_equal(chunk.view(np.float32), np.full(1 << 18, int(key[1:]), np.float32))
