"""abstract_target(): a checkpoint's tree as the target that restores it as saved.

A target built by hand (``jax.eval_shape`` of the init function) may give leaves other
shardings than the training step's, so the first step after a restore compiles another
program, or fails on a leaf that landed on one device. The manifest records each array
leaf's sharding as saved (its mesh's axis sizes and its spec): this rebuilds it on a mesh of
this job, and gives every other leaf what a restore needs: typed keys as key-typed
``ShapeDtypeStruct``s, bytes, Python values as saved, per-process leaves as ``tc.PerProcess()``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_ckpt import storage
from tpu_ckpt.catalog import open_checkpoint
from tpu_ckpt.format import LeafEntry, PerProcess, dtype_from_name, normalise_subtree, under, unflatten_nested
from tpu_ckpt.restoring import _leaf_kinds as leaf_kinds
from tpu_ckpt.restoring._plan import missing_subtree


def abstract_target(path: str | os.PathLike[str], mesh: Mesh | None = None, *, subtree: str | None = None) -> Any:
    """The checkpoint's tree (or its ``subtree``) as a restore target: each array leaf a
    ``jax.ShapeDtypeStruct`` with its saved dtype and its saved sharding placed on ``mesh``,
    typed PRNG keys as key-typed ones, bytes leaves as ``b""``, Python values as saved and
    ``tc.PerProcess`` leaves as ``tc.PerProcess()``. Reads the manifest only.

    Args:
      path: the checkpoint directory or URL.
      mesh: the mesh to place the saved shardings on; it must have the saved mesh's axis
        names. Default: a mesh of the saved axis sizes over ``jax.devices()`` (of the first
        NamedSharding leaf; every leaf saved on a NamedSharding must use the same axes).
        Leaves saved on one device or on the host come back replicated over the mesh (or
        over ``jax.devices()`` when the checkpoint has no mesh), not on one device. Leaves
        JAX cannot hold as saved (64-bit ones where ``jax_enable_x64`` is off) come back as
        numpy targets, restored exact on the host.
      subtree: a key path such as ``"params"``: only that part.

    Returns:
      Nested dicts/lists (as :func:`metadata` gives them) of ``jax.ShapeDtypeStruct`` leaves and
      the other leaves above: a target for :func:`restore` (with the same ``subtree``).

    Raises:
      CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError: as :func:`restore`.
      TargetMismatchError: ``subtree`` is not in the checkpoint.
      ValueError: the default mesh cannot be built from this job's devices (pass ``mesh``),
        or ``mesh`` lacks an axis a saved sharding uses.
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``, or ``subtree`` not a string.
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (jax.make_mesh(...)) or None, not a {type(mesh).__name__}")
    loc = storage.location(path)
    with open_checkpoint(loc, threads=1) as checkpoint:
        manifest = checkpoint.manifest
    prefix, depth = normalise_subtree(subtree)
    leaves = [leaf for leaf in manifest.leaves if under(leaf.key, prefix)]
    if prefix and not leaves:
        raise missing_subtree(manifest, prefix, loc.url)
    mesh = mesh if mesh is not None else _saved_mesh(leaves)
    return unflatten_nested((leaf.path[depth:], _abstract_leaf(leaf, mesh)) for leaf in leaves)


def _saved_mesh(leaves: list[LeafEntry]) -> Mesh:
    """The saved mesh's axis sizes over ``jax.devices()``; one axis over them all when no
    leaf was saved on a NamedSharding."""
    arrays = (leaf for leaf in leaves if leaf.kind == "array")
    named = next((leaf.sharding for leaf in arrays if (leaf.sharding or {}).get("type") == "NamedSharding"), None)
    devices = jax.devices()
    if named is None:
        return Mesh(np.array(devices), ("replica",))
    axes = named["mesh"]
    if int(np.prod(list(axes.values()))) != len(devices):
        raise ValueError(
            f"The checkpoint was saved on a mesh {axes} of {int(np.prod(list(axes.values())))} devices and this job "
            f"has {len(devices)}: pass tc.abstract_target(path, mesh=...) with a mesh of the same axis names."
        )
    names = named.get("axis_types")
    if (
        not isinstance(names, list) or len(names) != len(axes)
        or not all(n in ("Auto", "Explicit", "Manual") for n in names)
    ):
        names = ["Auto"] * len(axes)  # saved before axis types were recorded (or all Auto)
    types = tuple(getattr(jax.sharding.AxisType, n) for n in names)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices, axis_types=types)


def _abstract_leaf(leaf: LeafEntry, mesh: Mesh) -> Any:
    if leaf.kind == "value":
        return leaf.value
    if leaf.kind != "array":
        return PerProcess()
    if leaf.logical == "bytes":
        return b""
    dtype = dtype_from_name(leaf.dtype)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:  # 64 bits, which JAX without x64 would narrow
        return np.empty(leaf.shape, dtype)  # a host target: restored exact (untouched pages: no memory yet)
    sharding = _sharding(leaf, mesh)
    impl = leaf_kinds.saved_impl(leaf)
    if impl is not None:
        key_type, trailing = leaf_kinds.key_type(impl)
        shape = leaf.shape[: len(leaf.shape) - trailing]
        return jax.ShapeDtypeStruct(shape, key_type, sharding=_truncated(sharding, len(shape)))
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)


def _sharding(leaf: LeafEntry, mesh: Mesh) -> NamedSharding:
    saved = leaf.sharding or {}
    if saved.get("type") != "NamedSharding":
        return NamedSharding(mesh, P())
    used = {a for entry in saved["spec"] for a in ([entry] if isinstance(entry, str) else entry or [])}
    missing = used - set(mesh.axis_names)
    if missing:
        raise ValueError(
            f"Leaf {leaf.key!r} was saved sharded over axes {sorted(missing)}, which the mesh {dict(mesh.shape)} lacks."
        )
    return NamedSharding(mesh, P(*(tuple(e) if isinstance(e, list) else e for e in saved["spec"])))


def _truncated(sharding: NamedSharding, rank: int) -> NamedSharding:
    """A key's sharding: its key data's, less the key's own trailing axes (never sharded)."""
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[:rank]))
