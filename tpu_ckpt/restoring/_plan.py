"""The restore plan: for each target leaf, what comes back, from which pieces, in which batch.

Planning is pure: a :class:`~tpu_ckpt.format._manifest.Manifest` (format 2: with the piece-table rows the target needs
already loaded, see :func:`needed_slices`) and a target in, a :class:`RestorePlan` out, with no IO and no devices beyond
what the target's shardings name (``addressable_devices_indices_map``). So a resharding bug can be read off a printed
plan, and planning is tested without files, as PyTorch DCP tests its planners. ``_exec.py`` carries a plan out;
``_restore.py`` opens the checkpoint and loads the rows.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpu_ckpt.errors import TargetMismatchError
from tpu_ckpt.format import (
    LeafEntry,
    Manifest,
    PathEntry,
    PieceEntry,
    SliceSpec,
    byte_batches,
    dtype_from_name,
    flatten,
    full_slice,
    loaded_overlapping,
    normalise_subtree,
    tensor_name,
    under,
    unflatten_nested,
)
from tpu_ckpt.sharding import index_to_slice, local_indices


@dataclasses.dataclass(frozen=True, repr=False)
class Region:
    """One distinct global slice of a leaf this process needs, the devices that take it
    (none: it comes back on the host) and the pieces it is copied out of."""

    slice: SliceSpec
    devices: tuple[jax.Device, ...]
    pieces: tuple[PieceEntry, ...]

    def __repr__(self) -> str:
        where = f" on devices {[d.id for d in self.devices]}" if self.devices else ""
        reads = ", ".join(f"{_text(p.slice)} at {p.file}:{p.offset}" for p in self.pieces) or "nothing (empty)"
        return f"{_text(self.slice)}{where} reads {reads}"


@dataclasses.dataclass(frozen=True, repr=False)
class ArrayRead:
    """A target leaf read from the checkpoint: an array on ``sharding``, a numpy array
    (``sharding`` None) or a Python scalar of ``python_type``, in ``dtype``."""

    key: str
    leaf: LeafEntry
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None
    python_type: type | None
    regions: tuple[Region, ...]

    def __repr__(self) -> str:
        if self.python_type is not None:
            form = f"Python {self.python_type.__name__}"
        elif self.sharding is None:
            form = f"numpy {self.dtype}"
        else:
            form = f"{self.dtype} jax.Array on {_sharding_text(self.sharding)}"
        return f"{self.key}: {self.leaf.dtype}{list(self.leaf.shape)} -> {form}"


@dataclasses.dataclass(frozen=True, repr=False)
class NoRead:
    """A target leaf that comes back without a read: a saved Python value, or (a skipped
    slot variable) the target's own value, unchanged."""

    key: str
    value: Any
    skipped_slot: bool

    def __repr__(self) -> str:
        if self.skipped_slot:
            return f"{self.key}: left unchanged (skipped slot variable)"
        return f"{self.key}: saved value {self.value!r}"


@dataclasses.dataclass(frozen=True, repr=False)
class Unit:
    """Regions of one leaf read and placed together: every region, or for a leaf bigger
    than a read batch a single one, so that no batch holds much more than its bytes."""

    position: int  # the leaf's index in RestorePlan.leaves
    array: ArrayRead
    regions: tuple[Region, ...]
    whole: bool  # whether ``regions`` is every region of the leaf
    pieces: tuple[PieceEntry, ...]  # those of the regions, each once

    def __repr__(self) -> str:
        return self.array.key if self.whole else tensor_name(self.array.key, self.regions[0].slice)


@dataclasses.dataclass(frozen=True, repr=False)
class RestorePlan:
    """A restore as data: per target leaf (flatten order) what comes back, and the read
    batches, each of about ``batch_bytes``, that bring the array leaves in."""

    leaves: tuple[ArrayRead | NoRead, ...]
    batches: tuple[tuple[Unit, ...], ...]
    treedef: Any  # the target's; None: the result is nested dicts/lists built from ``paths``
    paths: tuple[tuple[PathEntry, ...], ...]  # per leaf, below the subtree (no target only)
    batch_bytes: int = 1 << 62

    def overlaps(self, i: int) -> bool:
        """Whether batch ``i + 1`` may be read while batch ``i`` is placed: not when a unit
        bigger than a batch (one device's region) makes the two exceed two batches."""
        nbytes = [sum(p.length for unit in self.batches[j] for p in unit.pieces) for j in (i, i + 1)]
        return sum(nbytes) <= 2 * self.batch_bytes

    def tree(self, results: Sequence[Any]) -> Any:
        """The restored tree from one result per leaf."""
        if self.treedef is not None:
            return jax.tree_util.tree_unflatten(self.treedef, results)
        return unflatten_nested((list(path), result) for path, result in zip(self.paths, results))

    def describe(self) -> str:
        """Every leaf with its regions and their pieces, then the read batches."""
        lines = [f"RestorePlan: {len(self.leaves)} leaves, {len(self.batches)} read batches"]
        for entry in self.leaves:
            lines.append(f"  {entry!r}")
            if isinstance(entry, ArrayRead):
                lines.extend(f"    {region!r}" for region in entry.regions)
        for i, batch in enumerate(self.batches):
            nbytes = sum(p.length for unit in batch for p in unit.pieces)
            lines.append(f"  batch {i} ({nbytes} bytes): {', '.join(map(repr, batch))}")
        return "\n".join(lines)

    __repr__ = describe


def plan_restore(
    manifest: Manifest, target: Any = None, subtree: str | None = None, skip_slots: bool = False, *,
    batch_bytes: int, url: str = "<manifest>",
) -> RestorePlan:
    """Plans restoring ``target`` (None: everything under ``subtree``) from ``manifest``, whose piece-table rows for
    :func:`needed_slices` are loaded (no IO here).

    ``url`` names the checkpoint in errors. Raises TargetMismatchError naming the key when the target does not fit."""
    entries, treedef, paths = plan_entries(manifest, target, subtree, skip_slots, url)
    batches = tuple(map(tuple, byte_batches(_units(entries, batch_bytes), _unit_bytes, batch_bytes)))
    return RestorePlan(tuple(entries), batches, treedef, paths, batch_bytes)


def plan_entries(
    manifest: Manifest, target: Any, subtree: str | None, skip_slots: bool, url: str, *, regions: bool = True
) -> tuple[list[ArrayRead | NoRead], Any, tuple[tuple[PathEntry, ...], ...]]:
    """Per target leaf what comes back, the treedef and (no target) the paths: the plan without batches.
    ``regions=False`` leaves ``ArrayRead.regions`` empty: ``check_restore`` counts a pod's million regions by layout
    (``restoring/_check_reads.py``), not one by one."""
    prefix, depth = normalise_subtree(subtree)
    leaves = {leaf.key: leaf for leaf in manifest.leaves if under(leaf.key, prefix)}
    if prefix and not leaves:
        raise missing_subtree(manifest, prefix, url)
    if target is None:
        kept = [leaf for leaf in leaves.values() if not (skip_slots and leaf.is_slot)]  # slots left out
        return [_whole(leaf, regions) for leaf in kept], None, tuple(tuple(leaf.path[depth:]) for leaf in kept)
    flat, treedef = flatten(target)
    planned = [plan_leaf(leaves, _join(prefix, key), t, skip_slots, url, regions=regions) for key, _, t in flat]
    return planned, treedef, ()


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix and key else prefix or key


def _whole(leaf: LeafEntry, regions: bool) -> ArrayRead | NoRead:
    """A leaf restored with no target: as saved, on the host."""
    if leaf.kind == "value":
        return NoRead(leaf.key, leaf.value, False)
    return _array_read(leaf.key, leaf, dtype_from_name(leaf.dtype), None, None, regions)


def plan_leaf(
    leaves: dict[str, LeafEntry], key: str, target: Any, skip_slots: bool, url: str, *, regions: bool = True
) -> ArrayRead | NoRead:
    """What to restore for one target leaf; a TargetMismatchError when it does not fit
    (``restoring/_check.py`` calls it leaf by leaf, to list every mismatch at once)."""
    leaf = leaves.get(key)
    if leaf is None:
        close = difflib.get_close_matches(key, list(leaves), n=3)
        hint = f"; similar keys: {close}" if close else f"; it has {len(leaves)} leaves under the requested part"
        raise TargetMismatchError(f"Target leaf {key!r} is not in checkpoint {url}{hint}", key=key, file=url)
    if leaf.kind == "value":
        return NoRead(key, leaf.value, False)
    if skip_slots and leaf.is_slot:
        return NoRead(key, target, True)  # not read; the target's own value comes back
    dtype, sharding, python_type, shape = _form(key, leaf, target)
    if shape != leaf.shape:
        raise TargetMismatchError(
            f"Target leaf {key!r} has shape {shape} but checkpoint {url} saved {leaf.shape}", key=key, file=url
        )
    saved = dtype_from_name(leaf.dtype)
    narrowed = sharding is not None and jax.dtypes.canonicalize_dtype(dtype) != dtype  # 64 bits without x64
    cast = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(saved, jnp.floating)
    if narrowed or (dtype != saved and not cast):
        raise TargetMismatchError(
            f"Target leaf {key!r} has dtype {dtype} but checkpoint {url} saved {saved}; " + (
                "JAX without jax_enable_x64 would narrow it on devices: restore it onto a numpy target "
                "(as tc.abstract_target gives it), or enable x64" if narrowed
                else "only float->float casts are done on restore (no silent int/float conversion)"),
            key=key, file=url,
        )
    return _array_read(key, leaf, dtype, sharding, python_type, regions)


def _form(
    key: str, leaf: LeafEntry, target: Any
) -> tuple[np.dtype, jax.sharding.Sharding | None, type | None, tuple[int, ...]]:
    """The dtype, sharding, Python type and shape a target leaf asks for."""
    if isinstance(target, (bool, int, float)) and not isinstance(target, np.generic):
        return _scalar_dtype(leaf, target), None, type(target), ()
    if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = target.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return np.dtype(target.dtype), sharding, None, tuple(target.shape)
    if isinstance(target, (np.ndarray, np.generic)):
        return target.dtype, None, None, tuple(target.shape)
    raise TargetMismatchError(
        f"Target leaf {key!r} is a {type(target).__name__}; use a jax.Array, "
        "jax.ShapeDtypeStruct, numpy array or Python scalar",
        key=key,
    )


def _scalar_dtype(leaf: LeafEntry, target: bool | int | float) -> np.dtype:
    """A Python scalar names a kind, not a width: an int target takes any saved integer
    (signed or not), a float any saved float (bfloat16 and float8 included)."""
    saved = dtype_from_name(leaf.dtype)
    if isinstance(target, bool):
        same_kind = saved.kind == "b"
    elif isinstance(target, int):
        same_kind = saved.kind in "iu"
    else:
        same_kind = bool(jnp.issubdtype(saved, jnp.floating))
    return saved if same_kind else np.asarray(target).dtype


def _array_read(
    key: str, leaf: LeafEntry, dtype: np.dtype, sharding: jax.sharding.Sharding | None, python_type: type | None,
    regions: bool = True,
) -> ArrayRead:
    """Each distinct global slice this process needs (one per addressable-device index of
    the sharding, or the whole array on the host), with its devices and pieces."""
    found: tuple[Region, ...] = ()
    if regions:
        devices = slice_devices(leaf.shape, sharding, everyone=False)
        found = tuple(Region(s, d, tuple(loaded_overlapping(leaf, s))) for s, d in devices.items())
    return ArrayRead(key, leaf, np.dtype(dtype), sharding, python_type, found)


def slice_devices(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding | None, everyone: bool
) -> dict[SliceSpec, tuple[jax.Device, ...]]:
    """Each distinct global slice of a leaf and the devices (this process's, or with ``everyone`` all) that take it;
    without a sharding, the whole leaf, on the host. Shared by every leaf of one shape and sharding (computed once: a
    pod's 2,200 leaves over 512 devices would be a million index conversions), so not to be changed."""
    if sharding is None:
        return {full_slice(shape): ()}
    return sharded_slices(shape, sharding, everyone)[0]


@functools.lru_cache(maxsize=256)
def sharded_slices(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, everyone: bool
) -> tuple[dict[SliceSpec, tuple[jax.Device, ...]], tuple[SliceSpec, ...]]:
    """:func:`slice_devices`, and its slices as one tuple (``load_rows`` looks a tuple up once per layout)."""
    devices: dict[SliceSpec, list[jax.Device]] = {}
    indices = sharding.devices_indices_map(shape) if everyone else local_indices(sharding, shape)  # O(local devices)
    for device, index in indices.items():
        devices.setdefault(full_slice(shape) if index is None else index_to_slice(index, shape), []).append(device)
    return {s: tuple(d) for s, d in devices.items()}, tuple(devices)


def needed_slices(
    manifest: Manifest, target: Any, subtree: str | None, skip_slots: bool, *,
    everyone: bool | Callable[[jax.sharding.Sharding, tuple[int, ...]], bool] = False,
) -> list[tuple[LeafEntry, Sequence[SliceSpec]]]:
    """The saved array leaves a restore of ``target`` reads and, of each, the slices this process's devices take
    (``everyone``: every process's, as ``load_and_broadcast`` and a multi-process ``check_restore`` plan; or of the
    leaves of a sharding and shape it is true of): the piece-table rows to load before planning. Pure; a target leaf
    that does not fit is left out, for the planner to report."""
    prefix, _ = normalise_subtree(subtree)
    leaves = {leaf.key: leaf for leaf in manifest.leaves if under(leaf.key, prefix) and leaf.kind == "array"}
    wanted = {k: None for k in leaves} if target is None else {_join(prefix, k): t for k, _, t in flatten(target)[0]}
    out: list[tuple[LeafEntry, Sequence[SliceSpec]]] = []
    for key, leaf_target in wanted.items():
        leaf = leaves.get(key)
        if leaf is None or (skip_slots and leaf.is_slot):
            continue
        if target is None:
            out.append((leaf, [full_slice(leaf.shape)]))
            continue
        try:
            _, sharding, _, shape = _form(key, leaf, leaf_target)
        except TargetMismatchError:
            continue
        if shape == leaf.shape:
            every = everyone if isinstance(everyone, bool) or sharding is None else everyone(sharding, shape)
            slices = (full_slice(shape),) if sharding is None else sharded_slices(shape, sharding, every)[1]
            out.append((leaf, slices))
    return out


def _units(entries: Sequence[ArrayRead | NoRead], batch_bytes: int) -> list[Unit]:
    units = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, ArrayRead):
            continue
        if entry.leaf.nbytes <= batch_bytes or len(entry.regions) == 1:
            units.append(_unit(position, entry, entry.regions, True))
        else:
            units.extend(_unit(position, entry, (region,), False) for region in entry.regions)
    return units


def _unit(position: int, entry: ArrayRead, regions: tuple[Region, ...], whole: bool) -> Unit:
    pieces = {(p.file, p.offset): p for region in regions for p in region.pieces}
    return Unit(position, entry, regions, whole, tuple(pieces.values()))


def _unit_bytes(unit: Unit) -> int:
    return sum(p.length for p in unit.pieces)


def _text(spec: SliceSpec) -> str:
    """A slice as the data files name it: ``[0:4,0:2]``."""
    return tensor_name("", spec)


def _sharding_text(sharding: jax.sharding.Sharding) -> str:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"NamedSharding(mesh={dict(sharding.mesh.shape)}, spec={tuple(sharding.spec)})"
    devices: set[jax.Device] = sharding.device_set  # jax.Device: jaxlib's own type has no stubs
    return f"{type(sharding).__name__}(devices={sorted(d.id for d in devices)})"


def missing_subtree(manifest: Manifest, prefix: str, url: str) -> TargetMismatchError:
    """A subtree the checkpoint lacks, named with the top-level keys it has (an NNX state's
    params are under the key its model was saved as, not ``params``)."""
    return TargetMismatchError(
        f"subtree {prefix!r} is not in checkpoint {url}; its top-level keys are "
        f"{sorted({leaf.key.split('/')[0] for leaf in manifest.leaves})}: pass one of them (or a key path under one) "
        "as subtree", key=prefix, file=url,
    )
