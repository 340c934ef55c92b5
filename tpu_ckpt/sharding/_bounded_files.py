"""Data files no bigger than a bound, planned for saves to object stores.

An object store takes each data file as one object. tensorstore's kvstore API takes a
whole ``bytes`` value, so the writer joins the file's buffers into one and tensorstore
copies that again, and a request that fails transiently is retried whole. A device's data
file on a pod is 1.6-6 GB: four in flight would hold tens of GB of host memory, and a retry
would re-send GBs. So ``plan_save``, given a bound (``Settings.object_bytes`` for an object
store), cuts every data file bigger than the bound into several files, each at most the
bound in total bytes: safetensors header and alignment padding included.

Pieces are packed in order and, where one does not fit in the room left, cut into
sub-blocks along their axes exactly as ``MaxShardSizePolicy`` cuts them (its packer,
``policies.Packer``). A restore reads any tiling of a leaf, so nothing about the format
changes: the files are only smaller and more numerous.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tpu_ckpt.format import PlannedPiece, SliceSpec, dtype_name, file_size
from tpu_ckpt.sharding._pieces import ShardableTensor, host_view
from tpu_ckpt.sharding._policies import Packer

HEADER_ROOM = 1 << 20
"""The most bytes of a bounded file kept for its header and padding when pieces are packed:
about 5,000 pieces' worth, and at most a sixteenth of the bound. A file whose pieces need
more is halved, by pieces, until each half fits."""


def bounded(
    files: Sequence[list[PlannedPiece]], max_bytes: int, shapes: Mapping[str, tuple[int, ...]]
) -> list[list[PlannedPiece]]:
    """``files`` (each its pieces, in writing order), each file bigger than ``max_bytes``
    cut into consecutive files of at most ``max_bytes``. ``shapes``: each array leaf's
    global shape.

    The one overflow is a file of one piece that cannot be cut (a single element, or a
    scalar, with its header bigger than the bound): a bound that small helps nobody.
    """
    out: list[list[PlannedPiece]] = []
    for pieces in files:
        if file_bytes(pieces) <= max_bytes:
            out.append(pieces)
            continue
        budget = max_bytes - min(HEADER_ROOM, max_bytes // 16)
        for packed in _FilePacker(budget, shapes).pack_pieces(pieces):
            out.extend(_halved(packed, max_bytes))
    return out


def file_bytes(pieces: Sequence[PlannedPiece]) -> int:
    """The size of the data file of ``pieces`` (in writing order), header and padding included."""
    return file_size((p.key, p.slice, dtype_name(p.data.dtype), tuple(p.data.shape), p.nbytes) for p in pieces)


class _FilePacker(Packer):
    """``MaxShardSizePolicy``'s packing (``policies.Packer``), its shards kept as lists of
    pieces in writing order: a piece that fits whole goes in as the object it is, so that a
    file of many small pieces is packed with no new object per piece (a shard's
    ``{key: {slice: array}}`` and the pieces made from it cost ~0.3 KB a piece). A piece
    that must be cut goes through the packer, which views its buffer only then. A file's
    pieces of one leaf are consecutive, so the order is the shards' (grouped by key)."""

    def __init__(self, max_bytes: int, shapes: Mapping[str, tuple[int, ...]]):
        super().__init__(max_bytes, host_view)
        self.shapes = shapes
        self.files: list[list[PlannedPiece]] = [[]]
        self.large_files: list[list[PlannedPiece]] = []

    def pack_pieces(self, pieces: Iterable[PlannedPiece]) -> list[list[PlannedPiece]]:
        for p in pieces:
            if p.slice and p.nbytes <= self.remaining:  # the packer's block that fits whole
                self.files[-1].append(p)
                self.remaining -= p.nbytes
            else:
                self._pack_one(ShardableTensor(p.data, p.key, p.slice, self.shapes[p.key], np.dtype(p.data.dtype)))
        return [f for f in self.files if f] + self.large_files

    def _open_shard(self) -> None:
        self.files.append([])
        self.remaining = self.max_shard_size

    def _put(self, key: str, spec: SliceSpec, tensor: Any) -> None:
        self.files[-1].append(PlannedPiece(key, spec, tensor, int(tensor.nbytes)))

    def _put_large(self, key: str, spec: SliceSpec, tensor: Any) -> None:
        self.large_files.append([PlannedPiece(key, spec, tensor, int(tensor.nbytes))])


def _halved(pieces: list[PlannedPiece], max_bytes: int) -> list[list[PlannedPiece]]:
    """``pieces``, or, when their header makes the file too big (many small pieces), two
    halves of them, each halved again as needed."""
    if len(pieces) < 2 or file_bytes(pieces) <= max_bytes:
        return [pieces]
    middle = len(pieces) // 2
    return _halved(pieces[:middle], max_bytes) + _halved(pieces[middle:], max_bytes)
