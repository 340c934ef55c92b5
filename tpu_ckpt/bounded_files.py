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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tpu_ckpt.format import dtype_name, safetensors_layout, tensor_name
from tpu_ckpt.pieces import Shard, ShardableTensor
from tpu_ckpt.policies import pack

HEADER_ROOM = 1 << 20
"""The most bytes of a bounded file kept for its header and padding when pieces are packed:
about 5,000 pieces' worth, and at most a sixteenth of the bound. A file whose pieces need
more is halved, by pieces, until each half fits."""


def bounded(shards: Sequence[Shard], max_bytes: int, shapes: Mapping[str, tuple[int, ...]]) -> list[Shard]:
    """``shards`` (data files, in order), each file bigger than ``max_bytes`` cut into
    consecutive files of at most ``max_bytes``. ``shapes``: each array leaf's global shape.

    The one overflow is a file of one piece that cannot be cut (a single element, or a
    scalar, with its header bigger than the bound): a bound that small helps nobody.
    """
    out: list[Shard] = []
    for shard in shards:
        if file_bytes(shard) <= max_bytes:
            out.append(shard)
            continue
        budget = max_bytes - min(HEADER_ROOM, max_bytes // 16)
        for part in pack(_pieces(shard, shapes), budget):
            out.extend(_halved(part, max_bytes))
    return out


def file_bytes(shard: Shard) -> int:
    """The size of the data file ``shard`` becomes, header and padding included (its pieces
    laid out in the order the save writes them)."""
    tensors = [
        (tensor_name(key, spec), dtype_name(data.dtype), tuple(data.shape), int(data.nbytes))
        for key, by_slice in shard.items()
        for spec, data in by_slice.items()
    ]
    return safetensors_layout(tensors).size


def _pieces(shard: Shard, shapes: Mapping[str, tuple[int, ...]]) -> list[ShardableTensor]:
    """The shard's pieces as the packer takes them."""
    return [
        ShardableTensor(data, key, spec, shapes[key], np.dtype(data.dtype))
        for key, by_slice in shard.items()
        for spec, data in by_slice.items()
    ]


def _halved(shard: Shard, max_bytes: int) -> list[Shard]:
    """``shard``, or, when its header makes it too big (many small pieces), its pieces split
    in two halves, each halved again as needed."""
    items = [(key, spec, data) for key, by_slice in shard.items() for spec, data in by_slice.items()]
    if len(items) < 2 or file_bytes(shard) <= max_bytes:
        return [shard]
    middle = len(items) // 2
    return _halved(_shard(items[:middle]), max_bytes) + _halved(_shard(items[middle:]), max_bytes)


def _shard(items: Sequence[tuple[str, Any, Any]]) -> Shard:
    shard: Shard = {}
    for key, spec, data in items:
        shard.setdefault(key, {})[spec] = data
    return shard
