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
``policies.pack``). A restore reads any tiling of a leaf, so nothing about the format
changes: the files are only smaller and more numerous.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from tpu_ckpt.format import PlannedPiece, dtype_name, file_size
from tpu_ckpt.sharding._pieces import ShardableTensor, host_view, planned
from tpu_ckpt.sharding._policies import pack

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
        for shard in pack(_shardable(pieces, shapes), budget, view=host_view):
            out.extend(_halved(planned(shard), max_bytes))
    return out


def file_bytes(pieces: Sequence[PlannedPiece]) -> int:
    """The size of the data file of ``pieces`` (in writing order), header and padding included."""
    return file_size((p.key, p.slice, dtype_name(p.data.dtype), tuple(p.data.shape), p.nbytes) for p in pieces)


def _shardable(pieces: Sequence[PlannedPiece], shapes: Mapping[str, tuple[int, ...]]) -> Iterator[ShardableTensor]:
    """The pieces as the packer takes them, one at a time (not one object per piece of the
    file at once): each keeps its device array (the packer views the buffer of a piece only
    when it cuts it)."""
    return (ShardableTensor(p.data, p.key, p.slice, shapes[p.key], np.dtype(p.data.dtype)) for p in pieces)


def _halved(pieces: list[PlannedPiece], max_bytes: int) -> list[list[PlannedPiece]]:
    """``pieces``, or, when their header makes the file too big (many small pieces), two
    halves of them, each halved again as needed."""
    if len(pieces) < 2 or file_bytes(pieces) <= max_bytes:
        return [pieces]
    middle = len(pieces) // 2
    return _halved(pieces[:middle], max_bytes) + _halved(pieces[middle:], max_bytes)
