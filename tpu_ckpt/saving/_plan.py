"""Planning a save: the leaves, and which pieces this process writes into which data files.

Planning is pure, as in PyTorch DCP's planners and Orbax's: ``plan_save`` reads the tree and
the arrays' shardings, calls the sharding callback and validates its result, and touches no
file and no other process. The processes still plan consistently without talking: each walks
the same leaves in the same order and sees the same global shardings (see
``pieces.WriteBalance``). The plan is data, so it can be printed (``describe()``) and tested
without storage; ``saving/_save.py`` carries it out and ``saving/_commit.py`` completes its manifest.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from tpu_ckpt.format import (
    PER_PROCESS,
    LeafEntry,
    Manifest,
    PerProcess,
    PlannedPiece,
    data_file_name,
    dtype_name,
    encode_value,
    flatten,
    metric_values,
    spread,
)
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.saving._per_process import host_digests
from tpu_ckpt.sharding import (
    BUILT_IN_POLICIES,
    LocalPieces,
    ShardingCallback,
    SlotPredicate,
    bounded,
    describe_sharding,
    planned,
    slot_keys,
    validate_shards,
)

_PYTHON_VALUES = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One data file this process writes: one shard of the sharding callback."""

    name: str
    pieces: tuple[PlannedPiece, ...]
    nbytes: int  # element bytes; the file adds its safetensors header and alignment padding
    on_device: bool = False  # pieces may be in an accelerator's memory (``data_writes.fetch_started``)


@dataclasses.dataclass(frozen=True, repr=False)
class SavePlan:
    """What one process's part of a save is, decided before any IO.

    Attributes:
      process_index: the process this plan is for.
      manifest: the manifest to commit, less what only the writes tell (where each piece
        landed, the data files' sizes): every leaf, the sharding callback's description,
        the process count and the metrics.
      files: the data files this process writes, in writing order.
      piece_count: the pieces handed to the sharding callback (which may cut them further).
      host_digests: a digest of each bytes leaf and small numpy leaf, which one process writes
        for all: the leader refuses to commit one that differs between processes.
    """

    process_index: int
    manifest: Manifest
    files: tuple[DataFile, ...]
    piece_count: int
    host_digests: tuple[tuple[str, str], ...] = ()  # (key, digest) of the small host leaves (``per_process``)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def named(self, token: str) -> SavePlan:
        """This plan with its data files named for the save with ``token`` (``format.spread``),
        which the plan, made before the staging area, does not know."""
        files = tuple(dataclasses.replace(f, name=spread(token, f.name)) for f in self.files)
        return dataclasses.replace(self, files=files)

    def __repr__(self) -> str:
        written = sum(len(f.pieces) for f in self.files)
        return (
            f"SavePlan(process {self.process_index} of {self.manifest.process_count}: "
            f"{_count(len(self.manifest.leaves), 'leaf', 'leaves')}; writes {_count(written, 'piece')}, "
            f"{self.nbytes:,} bytes, into {_count(len(self.files), 'data file')}; "
            f"sharding_callback={self.manifest.sharding_callback!r})"
        )

    def describe(self) -> str:
        """The plan in full, one leaf and one written piece a line, for a person to read."""
        width = max((len(leaf.key) for leaf in self.manifest.leaves), default=0)
        lines = [repr(self), f"leaves ({len(self.manifest.leaves)}):"]
        lines += [f"  {leaf.key:<{width}}  {_leaf_text(leaf)}" for leaf in self.manifest.leaves]
        lines.append(f"data files this process writes ({len(self.files)}):")
        for file in self.files:
            lines.append(f"  {file.name}  {_count(len(file.pieces), 'piece')}, {file.nbytes:,} bytes")
            lines += [f"    {p.name}  {dtype_name(p.data.dtype)}  {p.nbytes:,} bytes" for p in file.pieces]
        if self.manifest.metrics is not None:
            lines.append(f"metrics: {self.manifest.metrics}")
        return "\n".join(lines)


def plan_save(
    tree: Any,
    options: CheckpointOptions | None = None,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    is_slot: SlotPredicate | None = None,
    metrics: Mapping[str, Any] | None = None,
    max_file_bytes: int | None = None,
    group: frozenset[int] | None = None,
) -> SavePlan:
    """Plans this process's part of saving ``tree`` (see :func:`tpu_ckpt.save` for ``is_slot``
    and ``metrics``).

    ``process_index`` and ``process_count`` default to this process's place in the JAX job;
    the executor passes its coordinator's. ``max_file_bytes`` bounds every data file, header
    included, by cutting bigger ones (``sharding/_bounded_files.py``): the executor passes the
    ``object_bytes`` setting when the destination is an object store, where a file is one
    object. Raises what a save raises before writing: a leaf that a checkpoint cannot hold,
    or a sharding callback's invalid result.
    """
    options = options or CheckpointOptions()
    me = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    leaves, _ = flatten(tree, keep_none=True)
    entries, local = _leaf_entries(leaves, me, slot_keys(tree, leaves, is_slot), group)
    callback = options.sharding_callback
    groups = _arranged(callback, local)
    if max_file_bytes is not None:
        groups = bounded(groups, max_file_bytes, {entry.key: entry.shape for entry in entries})
    files = tuple(
        DataFile(data_file_name(me, number), tuple(group), sum(map(_NBYTES, group)), local.on_device)
        for number, group in enumerate(groups)
    )
    manifest = Manifest(
        tuple(entries), {}, count, callback.description, metrics=None if metrics is None else metric_values(metrics)
    )
    return SavePlan(me, manifest, files, len(local.pieces), host_digests(leaves) if count > 1 else ())


_NBYTES = operator.itemgetter(3)  # a PlannedPiece's size


def _arranged(callback: ShardingCallback, local: LocalPieces) -> list[list[PlannedPiece]]:
    """The sharding callback's data files, each its pieces in writing order."""
    arranged = callback.arrangement(local.pieces, local.devices)
    if arranged is not None:
        return arranged
    pieces = local.shardable()
    shards = callback(pieces)
    if type(callback) not in BUILT_IN_POLICIES:  # ours are tested to be valid; at a million pieces the check is seconds
        validate_shards(shards, pieces, callback.description)  # a list of shards: not None, a dict or a generator
    return [planned(shard) for shard in shards if shard]


def _leaf_entries(
    leaves: list[tuple[str, list, Any]], me: int, slots: set[str], group: frozenset[int] | None = None
) -> tuple[list[LeafEntry], LocalPieces]:
    """Manifest entries (without piece locations) for every leaf, and this process's pieces
    (``group``: the processes sharing the writing with it, ``LocalPieces``)."""
    entries, local = [], LocalPieces(me, group)
    # equal shapes and sharding descriptions, one object each: a state may have a million leaves
    shared: dict[Any, Any] = {}
    for key, path, leaf in leaves:
        if isinstance(leaf, _PYTHON_VALUES):
            entries.append(LeafEntry(key, path, "value", value=leaf))
            continue
        if isinstance(leaf, PerProcess):
            entries.append(LeafEntry(key, path, PER_PROCESS, value=per_process_value(key, leaf, me)))
            continue
        leaf, logical = _stored(key, leaf)
        try:
            name = dtype_name(leaf.dtype)
        except TypeError as e:
            raise TypeError(f"Leaf {key!r}: {e}") from None
        shape = _shared(shared, tuple(int(d) for d in leaf.shape))
        sharding = _shared(shared, leaf.sharding, describe_sharding, leaf) if isinstance(leaf, jax.Array) else None
        slot = key in slots
        entries.append(LeafEntry(key, path, "array", shape, name, slot, sharding, logical=logical))
        local.add(key, leaf, is_slot=slot)
    return entries, local


def _shared(seen: dict[Any, Any], key: Any, make: Callable[[Any], Any] | None = None, of: Any = None) -> Any:
    """The one object kept for ``key`` (made by ``make(of)``, or ``key`` itself)."""
    found = seen.get(key)
    if found is None:
        found = seen[key] = key if make is None else make(of)
    return found


def _stored(key: str, leaf: Any) -> tuple[Any, str]:
    """The array a leaf is stored as, and what a restore makes of it (``LeafEntry.logical``):
    bytes as uint8 data, a typed PRNG key as its key data and the name of its impl."""
    if isinstance(leaf, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(leaf), np.uint8), "bytes"
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(
            f"Leaf {key!r} is a {type(leaf).__name__}; a checkpoint holds arrays, typed PRNG keys, bytes, "
            "tc.PerProcess values and Python bool/int/float/str/None only."
        )
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf), f"prng_key:{jax.random.key_impl(leaf)}"
    return leaf, ""


def per_process_value(key: str, leaf: PerProcess, me: int) -> bytes:
    """This process's value of a ``PerProcess`` leaf as stored (``format.encode_value``): taken
    now, so an async save keeps the value it was given even if the caller changes it after."""
    if leaf.reshard is not None:
        raise TypeError(
            f"Leaf {key!r} is a PerProcess(reshard=...), which is a restore target; save PerProcess(value)."
        )
    return encode_value(leaf.value, key, me)


def _count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _leaf_text(leaf: LeafEntry) -> str:
    if leaf.kind == "value":
        return f"value {leaf.value!r}"
    if leaf.kind == PER_PROCESS:
        return f"per-process value, {len(leaf.value)} bytes from this process"
    text = f"{leaf.dtype}[{','.join(map(str, leaf.shape))}]" + (f" ({leaf.logical})" if leaf.logical else "")
    if leaf.is_slot:
        text += "  slot"
    sharding = leaf.sharding
    if sharding is None:
        return text + "  host value (written by process 0)"
    if sharding["type"] == "NamedSharding":
        return text + f"  NamedSharding mesh={sharding['mesh']} spec={sharding['spec']}"
    return text + f"  {sharding['type']} over {sharding['num_devices']} devices"
