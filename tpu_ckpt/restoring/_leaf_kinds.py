"""The leaves format 2.1 added, on restore: typed PRNG keys, bytes and per-process values.

A typed key and a bytes leaf are stored as arrays (key data; uint8), so the restore plan
reads them like any array: before planning, a target leaf that is a typed key becomes the
``ShapeDtypeStruct`` of its key data on the same sharding (:func:`stored_target`); after the
reads, the key data is wrapped as a typed key of the saved impl, and bytes become ``bytes``
(:func:`restored`). A per-process leaf is read here, before planning: this process's own
value (or, with another process count and a ``tc.PerProcess(reshard=fn)`` target, every
process's, handed to ``fn``), checked against its crc32c and decoded; the plan then sees a
plain value leaf (:func:`with_per_process_values`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from tpu_ckpt import cluster, storage
from tpu_ckpt.errors import CorruptCheckpointError, ProcessCountMismatchError, TargetMismatchError
from tpu_ckpt.format import (
    PER_PROCESS,
    LeafEntry,
    Manifest,
    PerProcess,
    PieceEntry,
    crc32c,
    decode_value,
    flatten,
    normalise_subtree,
    under,
)

_KEY = "prng_key:"


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix and key else prefix or key


def _target_leaves(target: Any, subtree: str | None) -> dict[str, Any]:
    prefix, _ = normalise_subtree(subtree)
    return {_join(prefix, key): leaf for key, _, leaf in flatten(target)[0]}


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def saved_impl(leaf: LeafEntry) -> str | None:
    """The impl of the typed PRNG keys ``leaf`` holds (``logical`` ``"prng_key:<impl>"``), or None."""
    return leaf.logical[len(_KEY):] if leaf.logical.startswith(_KEY) else None


@functools.cache
def key_type(impl: str) -> tuple[Any, int]:
    """The typed-key dtype of ``impl`` and its key data's trailing rank, without a computation."""
    try:
        key = jax.eval_shape(functools.partial(jax.random.key, 0, impl=impl))
    except (ValueError, TypeError, KeyError) as e:
        raise TargetMismatchError(
            f"The checkpoint holds typed PRNG keys of impl {impl!r}, unknown to this JAX: {e}"
        ) from None
    return key.dtype, len(jax.eval_shape(jax.random.key_data, key).shape)


def _any_key_or_bytes(target: Any) -> bool:
    """Whether ``target`` holds a typed key or a bytes leaf, found without key paths: a
    flatten with paths costs a restore of many small leaves ~13 us per leaf each time."""
    return any(is_key(x) or isinstance(x, (bytes, bytearray, memoryview)) for x in jax.tree.leaves(target))


def stored_target(manifest: Manifest, target: Any, subtree: str | None) -> Any:
    """``target`` with each typed-key leaf replaced by its key data's ``ShapeDtypeStruct``
    (same sharding; its shape is then checked as any array's) and each bytes leaf by a uint8
    array of the saved length: what the reads fill in. A typed-key target of another impl
    than the saved keys is a TargetMismatchError, every such leaf named at once."""
    if not _any_key_or_bytes(target):  # the usual target: kept as given, not flattened with its paths
        return target
    leaves = {leaf.key: leaf for leaf in manifest.leaves}
    keyed, treedef = flatten(target)
    prefix, _ = normalise_subtree(subtree)
    out, other_impls = [], []
    for key, _, leaf in keyed:
        saved = leaves.get(_join(prefix, key))
        if saved is not None and saved.kind == "array" and is_key(leaf):
            impl = saved_impl(saved)
            if impl is not None and key_type(impl)[0] != leaf.dtype:
                other_impls.append(f"{saved.key!r}: a {leaf.dtype} target, saved as {impl} keys")
            data = jax.eval_shape(jax.random.key_data, leaf)
            sharding = jax.random.key_data(leaf).sharding if isinstance(leaf, jax.Array) else leaf.sharding
            leaf = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        elif saved is not None and saved.kind == "array" and isinstance(leaf, (bytes, bytearray, memoryview)):
            leaf = np.empty(saved.shape, np.uint8)
        out.append(leaf)
    if other_impls:
        raise TargetMismatchError(
            f"{len(other_impls)} typed PRNG key target(s) of another impl than saved:\n  " + "\n  ".join(other_impls)
            + "\nRestore them with a target of the saved impl (tc.abstract_target gives it), then convert.",
            key=other_impls[0].split("'")[1],
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def restored(manifest: Manifest, tree: Any, target: Any, subtree: str | None) -> Any:
    """The restored ``tree`` with key data wrapped as typed keys (saved ones, unless the
    target holds a plain array there: it gets the key data; and where the target asked for a
    typed key) and bytes leaves as ``bytes``."""
    leaves = {leaf.key: leaf for leaf in manifest.leaves}
    has_keys = any(saved_impl(leaf) for leaf in manifest.leaves)
    given = _target_leaves(target, subtree) if target is not None and (has_keys or _any_key_or_bytes(target)) else {}
    asked = {k: v for k, v in given.items() if is_key(v)}
    plain = {k for k, v in given.items() if not is_key(v)}  # a saved key's data asked for as an array
    if not any(leaf.logical for leaf in manifest.leaves) and not asked:
        return tree
    keyed, treedef = flatten(tree)
    prefix, _ = normalise_subtree(subtree)
    out = []
    for key, _, leaf in keyed:
        full = _join(prefix, key)
        saved = leaves.get(full)
        impl = None if saved is None else saved_impl(saved)
        if saved is not None and saved.logical == "bytes":
            leaf = np.asarray(leaf).tobytes()
        elif (impl is not None and full not in plain) or full in asked:
            leaf = jax.random.wrap_key_data(leaf, impl=impl or str(jax.random.key_impl(asked[full])))
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def with_per_process_values(
    store: storage.ReadableStore, manifest: Manifest, target: Any, subtree: str | None, where: str
) -> Manifest:
    """``manifest`` with each per-process leaf the restore reads turned into a value leaf
    holding what this process gets back (see the module docstring)."""
    me, count = cluster.process_index(), cluster.process_count()
    leaves = list(manifest.leaves)
    for n, reshard in _wanted(manifest, target, subtree):
        leaf = leaves[n]
        if manifest.process_count == count:
            value = _read(store, leaf, [leaf.pieces[me]], where)[0]
        elif reshard is not None:
            value = reshard(_read(store, leaf, list(leaf.pieces), where), me, count)
        else:
            raise count_mismatch(leaf.key, manifest.process_count, count, where)
        leaves[n] = LeafEntry(leaf.key, leaf.path, "value", value=value)
    return dataclasses.replace(manifest, leaves=tuple(leaves))


def unread_per_process(manifest: Manifest, target: Any, subtree: str | None, where: str) -> tuple[Manifest, list[str]]:
    """``check_restore``'s view: each per-process leaf the restore reads as a value leaf (its
    value unread: the bytes each process saved), and a process count the restore would
    refuse as a problem."""
    count, problems = cluster.process_count(), []
    leaves = list(manifest.leaves)
    for n, reshard in _wanted(manifest, target, subtree):
        leaf = leaves[n]
        if manifest.process_count != count and reshard is None:
            problems.append(str(count_mismatch(leaf.key, manifest.process_count, count, where)))
        sizes = [p.length for p in leaf.pieces]
        value = f"<per-process value: {len(sizes)} processes, {sum(sizes)} bytes>"
        leaves[n] = LeafEntry(leaf.key, leaf.path, "value", value=value)
    return dataclasses.replace(manifest, leaves=tuple(leaves)), problems


def _wanted(manifest: Manifest, target: Any, subtree: str | None) -> list[tuple[int, Any]]:
    """The per-process leaves a restore of ``target`` reads, by number, each with the
    ``reshard`` function its target gives (or None)."""
    prefix, _ = normalise_subtree(subtree)
    if not any(leaf.kind == PER_PROCESS and under(leaf.key, prefix) for leaf in manifest.leaves):
        return []
    asked = None if target is None else _target_leaves(target, subtree)
    wanted = []
    for n, leaf in enumerate(manifest.leaves):
        if leaf.kind == PER_PROCESS and under(leaf.key, prefix) and (asked is None or leaf.key in asked):
            ask = None if asked is None else asked[leaf.key]
            wanted.append((n, ask.reshard if isinstance(ask, PerProcess) else None))
    return wanted


def count_mismatch(key: str, saved: int, count: int, where: str) -> ProcessCountMismatchError:
    return ProcessCountMismatchError(
        f"Leaf {key!r} of {where} holds one value per process, saved by {saved} processes, and this job has "
        f"{count}: which value each process gets is the program's decision. Put tc.PerProcess(reshard=fn) in "
        f"the target at {key!r}: each process then gets fn(saved_values, process_index, process_count).",
        key=key, saved_count=saved, process_count=count, file=where,
    )


def _read(store: storage.ReadableStore, leaf: LeafEntry, pieces: list[PieceEntry], where: str) -> list[Any]:
    """The values in ``pieces``, each checked against its crc32c and decoded; every read
    started before any is waited for."""
    reads = [store.read(p.file, p.offset, [p.length]) for p in pieces]
    values = []
    for piece, read in zip(pieces, reads):
        data = read.result()[0]
        if crc32c(np.ascontiguousarray(data)) != piece.crc32c:
            raise CorruptCheckpointError(
                f"{where}: the value of per-process key {leaf.key!r} saved by process {piece.slice[0][0]} fails its "
                f"crc32c ({piece.file} at byte {piece.offset}); restore another checkpoint.",
                key=leaf.key, file=piece.file,
            )
        values.append(decode_value(data, piece.file, leaf.key))
    return values
