"""The built-in sharding callbacks: which pieces go into which data file.

``MaxShardSizePolicy`` reproduces TensorFlow 2.21's ``MaxShardSizePolicy`` shard for shard and
slice for slice, so a size limit that worked for a TF model cuts a JAX model the same way. Two
TF defects are fixed on purpose: TF loops forever when no slab of a block fits in an empty
shard, and it silently drops zero-size tensors (which then fail to restore).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tpu_ckpt.format import SliceSpec
from tpu_ckpt.sharding._pieces import Shard, ShardableTensor, ShardingCallback, T


def _put(shard: Shard, key: str, slice_spec: SliceSpec, array: Any) -> None:
    shard.setdefault(key, {})[slice_spec] = array


class ShardByDevicePolicy(ShardingCallback):
    """One data file per device, so each device's pieces are copied to host and written together.

    Shards come in the order their device first appears among the pieces; host values (device
    ``None``) form a shard of their own.
    """

    @property
    def description(self) -> str:
        """TensorFlow's description of this policy, recorded in the manifest."""
        return "Split tensors into shards based on their device spec."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> list[Shard]:
        """The shards (data files) for ``shardable_tensors``, this process's pieces: see
        :meth:`ShardingCallback.__call__`."""
        tensors = list(shardable_tensors)  # a wrapping callback may pass any iterable
        return [_shard(group) for group in self.arrange(tensors, [t.device for t in tensors])]

    def arrange(self, pieces: Sequence[T], devices: Sequence[Any]) -> list[list[T]]:
        """Any ``pieces``, given each one's device in ``devices``, in the data files this policy
        makes: what ``__call__`` does without building shards (how a save plans a million pieces)."""
        groups: dict[Any, list[T]] = {}
        for piece, device in zip(pieces, devices):
            group = groups.get(device)
            if group is None:
                group = groups[device] = []
            group.append(piece)
        return list(groups.values())

    def arrangement(self, pieces: Sequence[T], devices: Sequence[Any]) -> list[list[T]] | None:
        """``arrange``'s groups of ``pieces`` by ``devices``; None for a subclass, which may cut
        differently (a save then calls it and checks its shards)."""
        return self.arrange(pieces, devices) if type(self) is ShardByDevicePolicy else None


class ShardByTaskPolicy(ShardingCallback):
    """One data file per process: the callback runs once per process, so all its pieces go in one shard."""

    @property
    def description(self) -> str:
        """TensorFlow's description of this policy, recorded in the manifest."""
        return "Split tensors into shards based on their device spec task."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> list[Shard]:
        """The shards (data files) for ``shardable_tensors``, this process's pieces: see
        :meth:`ShardingCallback.__call__`."""
        return [_shard(group) for group in self.arrange(list(shardable_tensors), ())]

    def arrange(self, pieces: Sequence[T], devices: Sequence[Any]) -> list[list[T]]:
        """As ``ShardByDevicePolicy.arrange``: all ``pieces`` in one data file, whatever their ``devices``."""
        return [list(pieces)] if pieces else []

    def arrangement(self, pieces: Sequence[T], devices: Sequence[Any]) -> list[list[T]] | None:
        """``arrange``'s one group of ``pieces``, whatever their ``devices``; None for a subclass,
        which may cut differently (a save then calls it and checks its shards)."""
        return self.arrange(pieces, devices) if type(self) is ShardByTaskPolicy else None


def _shard(tensors: Sequence[ShardableTensor]) -> Shard:
    shard: Shard = {}
    for piece in tensors:
        _put(shard, piece.checkpoint_key, piece.slice_spec, piece.tensor)
    return shard


class MaxShardSizePolicy(ShardingCallback):
    """Data files of at most ``max_shard_size`` bytes of raw element data, cut as TensorFlow 2.21 does.

    Pieces are packed greedily in input order; a piece that does not fit in the space left is cut
    into guillotine slabs along the axis that needs the fewest slabs (ties to the lowest axis).
    Where TF would loop forever (no slab along any axis fits even an empty shard) the block is
    cut into unit-thickness slabs, down to single elements if need be. A single element larger
    than the limit is the only thing that exceeds it; such elements (and oversized scalars) get
    a data file each, after all the others. Sizes count element bytes only, so a file may exceed
    the limit by its header.

    Args:
      max_shard_size: the most bytes of element data in one data file.

    Raises:
      ValueError: ``max_shard_size`` is not a positive int.
    """

    def __init__(self, max_shard_size: int):
        if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, numbers.Integral) or max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be a positive int (bytes), got {max_shard_size!r}")
        self.max_shard_size: int = int(max_shard_size)

    @property
    def description(self) -> str:
        """TensorFlow's description of this policy, recorded in the manifest."""
        return "Split tensors into shards with a max shard size."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> list[Shard]:
        """The shards (data files) for ``shardable_tensors``, this process's pieces: see
        :meth:`ShardingCallback.__call__`."""
        return pack(shardable_tensors, self.max_shard_size)


def pack(pieces: Iterable[ShardableTensor], max_bytes: int) -> list[Shard]:
    """``pieces`` in shards of at most ``max_bytes`` element bytes, packed and cut as
    ``MaxShardSizePolicy`` does (a save cutting data files to an object store's object size
    packs the same way through a ``Packer`` of its own: ``sharding/_bounded_files.py``)."""
    return Packer(max_bytes).pack(pieces)


class Packer:
    """The state of one ``MaxShardSizePolicy`` call (TF's ``MaxShardSizePartitioner``).

    Kept out of the policy object so that the policy's hash and any concurrent calls are not
    affected by a call in progress. ``view``: what a piece's tensor is sliced through when it
    is cut (a numpy view of a CPU buffer), taken only for the pieces cut.
    """

    def __init__(self, max_shard_size: int, view: Callable[[Any], Any] | None = None):
        self.max_shard_size = max_shard_size
        self.view = view
        self.shards: list[Shard] = [{}]
        self.large: list[Shard] = []
        self.remaining = max_shard_size

    def pack(self, pieces: Iterable[ShardableTensor]) -> list[Shard]:
        for piece in pieces:
            self._pack_one(piece)
        return [shard for shard in self.shards if shard] + self.large

    def _pack_one(self, piece: ShardableTensor) -> None:
        if piece.slice_spec == ():
            self._pack_scalar(piece)
        else:
            self._pack_block(piece, tuple(a for a, _ in piece.slice_spec), piece.slice_shape)

    def _open_shard(self) -> None:
        self.shards.append({})
        self.remaining = self.max_shard_size

    def _put(self, key: str, spec: SliceSpec, tensor: Any) -> None:
        """Adds a block to the current shard (a subclass may keep shards in another form)."""
        _put(self.shards[-1], key, spec, tensor)

    def _put_large(self, key: str, spec: SliceSpec, tensor: Any) -> None:
        """Adds a block bigger than the limit, in a shard of its own after all the others."""
        self.large.append({key: {spec: tensor}})

    def _pack_scalar(self, piece: ShardableTensor) -> None:
        """TF's scalar rule: whole into the current shard, a fresh one, or alone if over the limit."""
        nbytes = np.dtype(piece.dtype).itemsize
        if nbytes > self.max_shard_size:
            self._put_large(piece.checkpoint_key, (), piece.tensor)
            return
        if nbytes > self.remaining:
            self._open_shard()
        self._put(piece.checkpoint_key, (), piece.tensor)
        self.remaining -= nbytes

    def _pack_block(self, piece: ShardableTensor, start: tuple[int, ...], shape: tuple[int, ...]) -> None:
        """Packs the block ``shape`` at absolute offset ``start`` of ``piece`` (TF's ``get_shards`` loop).

        The block cuts slabs off its front until the rest fits in the current shard; then the
        rest goes in whole (a zero-size block counts 0 bytes, so it is always kept).
        """
        esize = np.dtype(piece.dtype).itemsize
        while math.prod(shape) * esize > self.remaining:
            axis, thickness = _next_partition(shape, esize, self.remaining)
            if thickness > 0:
                self._add_slab(piece, start, _with_extent(shape, axis, thickness), esize)
                start, shape = _rest(start, shape, axis, thickness)
            elif self.remaining < self.max_shard_size:
                self._open_shard()
            elif math.prod(shape) == 1:
                # A single element larger than the whole limit: the only allowed overflow.
                self._put_large(piece.checkpoint_key, *self._cut(piece, start, shape))
                return
            else:
                # TF loops forever here: no slab fits even an empty shard. Pack a unit slab the
                # same way (which cuts it along its other axes), then go on with the rest.
                axis = next(a for a, n in enumerate(shape) if n > 1)
                self._pack_block(piece, start, _with_extent(shape, axis, 1))
                start, shape = _rest(start, shape, axis, 1)
        self._put(piece.checkpoint_key, *self._cut(piece, start, shape))
        self.remaining -= math.prod(shape) * esize

    def _add_slab(self, piece: ShardableTensor, start: tuple[int, ...], shape: tuple[int, ...], esize: int) -> None:
        """TF's ``_add_partition``: a slab that fits; a shard filled exactly is closed at once."""
        self._put(piece.checkpoint_key, *self._cut(piece, start, shape))
        self.remaining -= math.prod(shape) * esize
        if self.remaining == 0:
            self._open_shard()

    def _cut(self, piece: ShardableTensor, start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[SliceSpec, Any]:
        """The block's slice and data, sliced from the piece's own tensor (the piece's own
        slice and tensor when uncut: no new object per piece of a state of many small leaves)."""
        spec = _spec(start, shape)
        if spec == piece.slice_spec:
            return piece.slice_spec, piece.tensor
        tensor = piece.tensor if self.view is None else self.view(piece.tensor)
        return spec, tensor[tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(spec, piece.slice_spec))]


def _next_partition(shape: tuple[int, ...], esize: int, remaining: int) -> tuple[int, int]:
    """TF's ``_get_next_partition``: the axis and slab thickness that best fill ``remaining`` bytes.

    For each axis, count the slabs of the largest thickness that fits; keep axis 0 unless a later
    axis needs strictly fewer slabs (and its average slab fits). Thickness 0 means no slab fits.
    """
    count = math.prod(shape)

    def num_slabs(axis: int) -> float:
        fit = remaining // ((count // shape[axis]) * esize)
        return math.inf if fit == 0 else -(-shape[axis] // fit)

    best_axis, best = 0, num_slabs(0)
    for axis in range(1, len(shape)):
        slabs = num_slabs(axis)
        # TF's test count*esize/slabs <= remaining, in exact integers. It always holds for a
        # finite slab count; kept so the choice reads exactly as TF's.
        if slabs < best and count * esize <= remaining * slabs:
            best_axis, best = axis, slabs
    if best == math.inf:
        return best_axis, 0
    return best_axis, -(-shape[best_axis] // int(best))


def _with_extent(shape: tuple[int, ...], axis: int, extent: int) -> tuple[int, ...]:
    return shape[:axis] + (extent,) + shape[axis + 1 :]


def _rest(
    start: tuple[int, ...], shape: tuple[int, ...], axis: int, thickness: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What is left of a block after a slab of ``thickness`` is cut off its front along ``axis``."""
    new_start = start[:axis] + (start[axis] + thickness,) + start[axis + 1 :]
    return new_start, _with_extent(shape, axis, shape[axis] - thickness)


def _spec(start: tuple[int, ...], shape: tuple[int, ...]) -> SliceSpec:
    return tuple((a, a + n) for a, n in zip(start, shape))


BUILT_IN_POLICIES = (ShardByDevicePolicy, ShardByTaskPolicy, MaxShardSizePolicy)
"""Callbacks whose results need no validation: tests/test_policies.py proves them valid."""
