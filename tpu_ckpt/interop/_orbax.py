"""import_orbax() and export_orbax(): moving checkpoints between Orbax and tpu_ckpt.

A team with a year of Orbax checkpoints needs them to move, and one trying tpu_ckpt needs a way back. Orbax is read and
written through its own public API (``PyTreeCheckpointer``, ``StandardCheckpointer``, ``CheckpointManager``), never by
parsing its files, so whatever layout it used (OCDBT or not, zarr3 or not) is its business. What Orbax would trust and
should not, a FIFO, a link out, a 4 TiB array declared in a damaged ``.zarray``, is refused before Orbax reads it, and
what it raises on a damaged file becomes our typed error (``interop/_orbax_checks.py``).

An import streams: the leaves are read from Orbax a batch at a time (at most
``max_batch_bytes`` of arrays, a larger leaf alone), each batch written as one data file of
the new checkpoint before the next is read (``saving/_stream_write.py``). The arrays held at once
are one batch; Orbax and tensorstore keep their own read buffers on top. Keys are Orbax's
key paths joined by ``/``, which are the keys ``tc.save`` gives the same tree, so a target
that restored the Orbax checkpoint restores the converted one. Slot flags are decided by
``sharding/_slots.py`` on the tree Orbax restores (or on ``target``), as ``tc.save`` of that tree would.
An export refuses, naming the key, a leaf Orbax cannot hold (``_orbax_checks.check_exportable``).
Orbax is an optional dependency: it is imported inside the functions (see ``_orbax``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
from typing import Any

import jax
import numpy as np

from tpu_ckpt import catalog, storage
from tpu_ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tpu_ckpt.format import LeafEntry, byte_batches, dtype_name, flatten, join, path_entries
from tpu_ckpt.interop import _orbax_checks as orbax_checks
from tpu_ckpt.interop import _orbax_items as orbax_items
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restoring import restore_from
from tpu_ckpt.saving import StreamWriter
from tpu_ckpt.sharding import SlotPredicate, slot_keys

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_BYTES = 1 << 30
_PYTHON_VALUES = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class ImportReport:
    """One Orbax checkpoint converted (or, with ``skipped``, found converted already).

    Attributes:
      src: the Orbax checkpoint read.
      dst: the tpu_ckpt checkpoint written.
      step: the manager step it came from, or ``None`` for a lone checkpoint.
      leaves: how many leaves were converted.
      nbytes: how many bytes of array data were converted.
      batches: the bytes of arrays read and held in memory by each batch, in order: each is
        at most ``max_batch_bytes``, or one leaf larger than that.
      skipped: ``dst`` was committed already (an earlier, interrupted import), so nothing was read.
    """

    src: str
    dst: str
    step: int | None
    leaves: int = 0
    nbytes: int = 0
    batches: tuple[int, ...] = ()
    skipped: bool = False

    @property
    def peak_batch_bytes(self) -> int:
        """The most array bytes held in memory at once (the largest batch)."""
        return max(self.batches, default=0)


def import_orbax(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    item: str | None = None,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    is_slot: SlotPredicate | None = None,
    target: Any = None,
) -> list[ImportReport]:
    """Converts an Orbax PyTree/Standard checkpoint, or an Orbax ``CheckpointManager``
    directory, into tpu_ckpt checkpoints. Steps already committed in ``dst`` are skipped,
    so an interrupted import resumes.

    Args:
      src: one checkpoint (as ``StandardCheckpointer.save`` writes it), one step of a
        manager (holding items such as ``default/``), or a manager's directory. A step's JSON
        items (``ocp.args.JsonSave``) come too: the tree is then ``{item: tree, json_item:
        value, ...}`` (``interop/_orbax_items.py``).
      dst: the tpu_ckpt checkpoint; for a manager's directory, a tpu_ckpt
        ``CheckpointManager`` directory of ``dst/step_<n>``.
      item: the item to convert when a step holds several PyTree items.
      max_batch_bytes: at most this many bytes of arrays are read and held at once.
      is_slot: decides the slot flags as in ``tc.save(target, is_slot=...)``; without a
        ``target`` it gets a ``jax.ShapeDtypeStruct`` per leaf, the data not being read yet.
      target: the tree to restore the Orbax checkpoint as; without it, nested dicts and lists.

    Returns:
      One :class:`ImportReport` per checkpoint, in step order.

    Raises:
      ImportError: orbax-checkpoint is not installed.
      ValueError: ``max_batch_bytes`` is not positive, or ``target`` lacks leaves of ``src``.
      CheckpointNotFoundError: ``src`` is no Orbax PyTree checkpoint (or lacks ``item``).
      CorruptCheckpointError: Orbax cannot read a file of ``src``.
    """
    if max_batch_bytes < 1:
        raise ValueError(f"max_batch_bytes must be positive, got {max_batch_bytes}")
    ocp, epath = _orbax()
    source = _orbax_path(epath, src)
    options = dict(max_batch_bytes=max_batch_bytes, is_slot=is_slot, target=target)
    if _is_pytree(source):
        return [_convert(ocp, source, dst, None, **options)]
    steps = orbax_checks.step_directories(source)
    if not steps:
        return [_convert(ocp, _item(source, item), dst, None, items=orbax_items.json_items(ocp, source), **options)]
    done = _committed_steps(dst)
    reports = []
    for step, path in steps.items():
        target_path = storage.location(dst).child(f"step_{step}")
        if step in done:
            logger.info("tpu_ckpt: step %d is already in %s; skipped", step, dst)
            reports.append(ImportReport(str(path), target_path, step, skipped=True))
            continue
        reports.append(_convert(ocp, _item(path, item), target_path, step,
                                items=orbax_items.json_items(ocp, path), **options))
    return reports


def export_orbax(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, target: Any = None) -> list[str]:
    """Writes tpu_ckpt checkpoint ``src`` as an Orbax ``StandardCheckpointer`` checkpoint
    ``dst``, or a tpu_ckpt ``CheckpointManager`` directory as an Orbax ``CheckpointManager``
    directory (``dst/<step>/default``).

    Args:
      src: a tpu_ckpt checkpoint, or a tpu_ckpt ``CheckpointManager`` directory.
      dst: where Orbax writes.
      target: Orbax saves whole trees, so each checkpoint is restored whole first: into host
        memory without ``target``, or onto the devices and shardings ``target`` names.

    Returns:
      The paths of the Orbax checkpoints written.

    Raises:
      ImportError: orbax-checkpoint is not installed.
      CheckpointNotFoundError: ``src`` holds no committed checkpoint.
      TargetMismatchError: ``target`` does not match a checkpoint.
      CorruptCheckpointError: a data file of ``src`` is missing or fails its checksum.
      ValueError: a checkpoint holds a leaf Orbax cannot hold (``tc.PerProcess``, bytes), named.
    """
    ocp, epath = _orbax()
    try:
        checkpoint = catalog.open_checkpoint(src)
    except CheckpointNotFoundError as error:
        steps = catalog.checkpoints_in(src)
        committed = {step: name for name, step in steps.items() if step is not None}
        if not committed:
            raise error from None
        return _export_steps(ocp, _orbax_path(epath, dst), storage.location(src), committed, target)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(_orbax_path(epath, dst), _restored(checkpoint, target))
    checkpointer.wait_until_finished()
    logger.info("tpu_ckpt: exported %s to Orbax checkpoint %s", src, dst)
    return [os.fspath(dst)]


def _export_steps(ocp: Any, dst: Any, src: storage.Location, committed: dict[int, str], target: Any) -> list[str]:
    written = []
    for step in sorted(committed):
        with catalog.open_checkpoint(src.child(committed[step])) as checkpoint:
            orbax_checks.check_exportable(checkpoint.manifest, checkpoint.where)
    with ocp.CheckpointManager(dst) as manager:
        for step in sorted(committed):
            tree = _restored(catalog.open_checkpoint(src.child(committed[step])), target)
            manager.save(step, args=ocp.args.StandardSave(tree), force=True)
            manager.wait_until_finished()  # one step in memory at a time
            written.append(os.fspath(dst / str(step)))
    logger.info("tpu_ckpt: exported %d steps of %s to Orbax CheckpointManager directory %s", len(written), src.url, dst)
    return written


def _restored(checkpoint: catalog.OpenCheckpoint[Any], target: Any) -> Any:
    """The whole tree of an open checkpoint (closed after), as ``tc.restore`` gives it."""
    with checkpoint:
        orbax_checks.check_exportable(checkpoint.manifest, checkpoint.where)
        return restore_from(checkpoint, target, CheckpointOptions(), None, None)[0]


def _orbax() -> tuple[Any, Any]:
    """Orbax and its path type (etils.epath, an Orbax dependency), or an ImportError that
    says which extra to install."""
    try:
        import orbax.checkpoint as ocp
        from etils import epath
    except ImportError as e:
        raise ImportError(
            f"Orbax interop needs orbax-checkpoint, which is not installed ({e}): pip install orbax-checkpoint "
            "(tpu_ckpt's [flax] and [orbax] extras bring it)"
        ) from e
    return ocp, epath


def _orbax_path(epath: Any, path: str | os.PathLike[str]) -> Any:
    """``path`` as Orbax takes it: a local path made absolute (Orbax refuses a relative one)."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _convert(
    ocp: Any, path: Any, dst: Any, step: int | None, *, max_batch_bytes: int, is_slot: SlotPredicate | None,
    target: Any, items: dict[str, Any] | None = None,
) -> ImportReport:
    """Converts PyTree item ``path``, with the JSON ``items`` of its step (``_orbax_items``)."""
    root = os.fspath(path)
    orbax_checks.check_files(root)
    checkpointer = ocp.PyTreeCheckpointer()
    with orbax_checks.orbax_errors(root):  # the handler's own error, which the checkpointer logs and drops
        tree = ocp.PyTreeCheckpointHandler().metadata(path).tree
    whole, orbax_keys = orbax_items.composite(tree, path.name, items or {})

    def read(keys: set[str]) -> dict[str, Any]:
        """Leaves of the item by their keys in ``whole``."""
        got = _read_named(checkpointer, path, tree, {orbax_keys[key] for key in keys}, ocp)
        return {key: got[orbax_keys[key]] for key in keys}

    flat, _ = flatten(whole, keep_none=True)
    is_array = {key: _is_array(ocp, meta) for key, _, meta in flat}
    slots = _slots(whole, flat, is_array, is_slot, target)
    entries = [_entry(key, path_, meta, is_array[key], key in slots) for key, path_, meta in flat]
    values = read({k for k, _, meta in flat if k in orbax_keys and not is_array[k] and meta is not None})
    values.update({key: value for key, _, value in flat if key not in orbax_keys})  # the JSON items'
    entries = [dataclasses.replace(e, value=_value(e.key, values[e.key])) if e.key in values else e for e in entries]
    arrays = [e for e in entries if e.kind == "array"]
    planned = byte_batches(arrays, operator.attrgetter("nbytes"), max_batch_bytes)
    orbax_checks.check_memory(root, planned)
    batches = []
    with StreamWriter(dst, entries, f"imported from Orbax checkpoint {path}") as writer:
        for batch in planned:
            writer.write(read({e.key for e in batch}))
            batches.append(sum(e.nbytes for e in batch))
        url = writer.commit()
    report = ImportReport(str(path), url, step, len(entries), sum(batches), tuple(batches))
    logger.info(
        "tpu_ckpt: imported %s as %s (%d leaves, %.1f MB in %d batches, at most %.1f MB held)",
        path, url, report.leaves, report.nbytes / 1e6, len(batches), report.peak_batch_bytes / 1e6,
    )
    return report


def _is_array(ocp: Any, meta: Any) -> bool:
    """Orbax's arrays (numpy and jax) become array leaves; its scalars (Python numbers, which it restores as such),
    strings and Nones become saved values, as ``tc.save`` of the restored tree would store them."""
    return isinstance(meta, ocp.metadata.ArrayMetadata) and not isinstance(meta, ocp.metadata.ScalarMetadata)


def _slots(tree: Any, flat: list, is_array: dict[str, bool], is_slot: SlotPredicate | None, target: Any) -> set[str]:
    if target is None:
        shadow = [(k, p, jax.ShapeDtypeStruct(m.shape, m.dtype) if is_array[k] else None) for k, p, m in flat]
        return slot_keys(tree, shadow, is_slot)
    named, _ = flatten(target, keep_none=True)
    missing = sorted(k for k, array in is_array.items() if array and k not in {key for key, _, _ in named})
    if missing:
        raise ValueError(f"target has no leaves {missing[:5]} of the Orbax checkpoint; it must describe the same tree")
    return slot_keys(target, named, is_slot)


def _entry(key: str, path: list, meta: Any, is_array: bool, slot: bool) -> LeafEntry:
    if not is_array:
        return LeafEntry(key, path, "value")
    shape = tuple(int(d) for d in meta.shape)
    return LeafEntry(key, path, "array", shape, dtype_name(meta.dtype), slot and bool(shape), _sharding(meta.sharding))


def _sharding(meta: Any) -> dict[str, Any] | None:
    """Orbax's record of the saved sharding, as tpu_ckpt describes one (``tpu-ckpt inspect``
    shows it; a restore never needs it)."""
    if meta is None:
        return None
    if not hasattr(meta, "axis_names"):
        return {"type": type(meta).__name__.removesuffix("Metadata"), "num_devices": 1}
    spec = [list(p) if isinstance(p, tuple) else p for p in meta.partition_spec]
    return {"type": "NamedSharding", "mesh": dict(zip(meta.axis_names, (int(n) for n in meta.shape))), "spec": spec}


def _read_named(checkpointer: Any, path: Any, tree: Any, wanted: set[str], ocp: Any) -> dict[str, Any]:
    """:func:`_read`, whose errors name the leaf that cannot be read: a batch that fails is read again in halves, down
    to the failing leaf (on the error path only: at most twice the batch, and never more memory than it)."""
    ordered = sorted(wanted)
    try:
        with orbax_checks.orbax_errors(os.fspath(path), ordered):
            return _read(checkpointer, path, tree, wanted, ocp)
    except CorruptCheckpointError:
        if len(ordered) > 1:
            for half in (ordered[: len(ordered) // 2], ordered[len(ordered) // 2 :]):
                _read_named(checkpointer, path, tree, set(half), ocp)
        raise


def _read(checkpointer: Any, path: Any, tree: Any, wanted: set[str], ocp: Any) -> dict[str, Any]:
    """The ``wanted`` leaves, by key: arrays as numpy arrays, values as Orbax restores them.
    Every other leaf is Orbax's PLACEHOLDER, which it does not read."""
    if not wanted:
        return {}

    def key_of(path_: Any) -> str:
        return join(path_entries(path_))

    def item(path_: Any, meta: Any) -> Any:
        return meta if key_of(path_) in wanted else ocp.PLACEHOLDER

    def restore_args(path_: Any, meta: Any) -> Any:
        numpy = key_of(path_) in wanted and _is_array(ocp, meta)
        return ocp.RestoreArgs(restore_type=np.ndarray) if numpy else ocp.RestoreArgs()

    args = ocp.args.PyTreeRestore(
        item=jax.tree_util.tree_map_with_path(item, tree),
        restore_args=jax.tree_util.tree_map_with_path(restore_args, tree),
    )
    restored, _ = flatten(checkpointer.restore(path, args=args), keep_none=True)
    return {key: value for key, _, value in restored if key in wanted}


def _value(key: str, value: Any) -> Any:
    value = value.item() if isinstance(value, np.generic | np.ndarray) and np.ndim(value) == 0 else value
    if not isinstance(value, _PYTHON_VALUES):
        raise TypeError(f"Orbax leaf {key!r} is a {type(value).__name__}, which tpu_ckpt cannot store as a value")
    return value


def _is_pytree(path: Any) -> bool:
    """Whether ``path`` is one Orbax PyTree checkpoint (an item), not a step or a manager."""
    return (path / "_METADATA").exists() or (path / "manifest.ocdbt").exists()


def _item(step: Any, name: str | None) -> Any:
    """The PyTree item of one manager step: ``name``, or the only one there is."""
    if not step.is_dir():
        raise CheckpointNotFoundError(f"No Orbax checkpoint at {step}", file=str(step))
    items = sorted(child.name for child in step.iterdir() if child.is_dir() and _is_pytree(child))
    if name is not None:
        if name not in items:
            raise CheckpointNotFoundError(f"{step} holds no Orbax PyTree item {name!r}; it holds {items}",
                                          file=str(step))
        return step / name
    if len(items) != 1:
        found = f"several ({', '.join(items)}): choose one with item=... (--item)" if items else "none"
        raise CheckpointNotFoundError(f"{step} is no Orbax PyTree checkpoint, and its PyTree items are {found}",
                                      file=str(step))
    return step / items[0]


def _committed_steps(dst: Any) -> set[int]:
    try:
        return {step for step in catalog.checkpoints_in(dst).values() if step is not None}
    except CheckpointNotFoundError:
        return set()
