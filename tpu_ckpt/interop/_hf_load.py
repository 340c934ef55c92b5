"""load_safetensors(): Hugging Face safetensors files straight onto a target's shardings.

The headers are read and checked first (``_hf_layout``), and the whole target with them:
every name, shape and dtype that does not fit is reported at once. Then, per leaf, each
distinct slice this process's devices hold (or the whole tensor, for a numpy target) is
read as the row-major runs of bytes it is made of: a slice whose trailing dimensions are
whole is one run per combination of its leading indices, and an unsharded tensor is one
run. Runs are read a batch at a time into the slice's host array, then placed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.errors import CorruptCheckpointError, TargetMismatchError
from tpu_ckpt.format import SliceSpec, dtype_from_name, extent, flatten, full_slice
from tpu_ckpt.interop import _hf_layout as layout
from tpu_ckpt.interop._hf_names import Named, Names, resolve
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.settings import settings
from tpu_ckpt.sharding import index_to_slice


def load_safetensors(
    src: str | os.PathLike[str], target: Any, *, names: Names = None, options: CheckpointOptions | None = None
) -> Any:
    """Reads Hugging Face safetensors weights onto ``target``'s shardings.

    Args:
      src: a ``.safetensors`` file, or a directory (or object-store prefix) holding
        ``model.safetensors.index.json`` or ``*.safetensors`` files.
      target: a pytree of ``jax.Array``, ``jax.ShapeDtypeStruct`` (with ``sharding``) or
        numpy arrays, giving each leaf's shape, dtype and placement.
      names: as for ``export_for_serving(layout="huggingface")``, keyed by the target's key
        paths (``None``: the key path joined by ``.``); a ``transpose`` spec reverses the
        stored tensor's axes back.
      options: ``host_memory_limit`` bounds the bytes read at once (beyond the slices
        being assembled).

    Returns:
      ``target``'s tree with every array leaf read (a leaf whose spec is ``None`` comes back
      as given).

    Raises:
      TargetMismatchError: names missing from the files, or shapes or dtypes that differ
        (only float->float casts are done), all listed at once.
      CorruptCheckpointError: a header or index that is malformed or hostile, a file that is
        missing, short or not a regular file.
    """
    folder, only = _source(storage.location(src))
    batch = _batch_bytes(options or CheckpointOptions())
    triples, treedef = flatten(target)
    found = resolve(names, [(key, key.replace("/", ".")) for key, _, _ in triples])
    with storage.Store(folder) as store:
        entries = _catalog(store, folder, only)
        _check(triples, found, entries, folder.url)
        results = [
            leaf if named is None else _load_leaf(store, entries[named.name], named, leaf, batch)
            for (_, _, leaf), named in zip(triples, found)
        ]
    return jax.tree_util.tree_unflatten(treedef, results)


def _source(loc: storage.Location) -> tuple[storage.Location, str | None]:
    """The directory to read and, when ``loc`` is a file, its name."""
    if not loc.url.rstrip("/").endswith(".safetensors"):
        return loc, None
    parent, _, name = loc.url.rstrip("/").rpartition("/")
    return storage.location(parent or "."), name


def _batch_bytes(options: CheckpointOptions) -> int:
    limit = options.host_memory_limit
    return settings().read_batch_bytes if limit is None else max(limit // 4, 1)


def _catalog(store: storage.Backend, folder: storage.Location, only: str | None) -> dict[str, layout.Entry]:
    """Every tensor of the files, by name, headers checked; with an index, every name it
    lists must be in the file it names."""
    weight_map: dict[str, str] | None = None
    if only is not None:
        files = [only]
    else:
        raw = store.read_file(layout.INDEX_FILE, layout.MAX_INDEX_BYTES)
        if raw is not None:
            weight_map = layout.decode_index(raw, folder.child(layout.INDEX_FILE))
            files = sorted(set(weight_map.values()))
        else:
            files = [name for name in store.list() if name.endswith(".safetensors") and "/" not in name]
    if not files:
        raise CorruptCheckpointError(f"{folder.url} holds no .safetensors file and no index", file=folder.url)
    entries: dict[str, layout.Entry] = {}
    for file in files:
        for entry in _header(store, folder, file):
            if entries.setdefault(entry.tensor.name, entry) is not entry:
                where = folder.child(file)
                raise CorruptCheckpointError(f"{where} and {entries[entry.tensor.name].file} both hold tensor {entry.tensor.name!r}", file=where)
    for name, file in (weight_map or {}).items():
        if name not in entries or entries[name].file != file:
            where = folder.child(layout.INDEX_FILE)
            raise CorruptCheckpointError(f"{where} puts tensor {name!r} in {file}, which does not hold it", file=where)
    return entries


def _header(store: storage.Backend, folder: storage.Location, file: str) -> list[layout.Entry]:
    where = folder.child(file)
    try:
        size = storage.file_size(folder, file)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where} is missing", file=where) from None
    if size is not None and size < 8:
        raise CorruptCheckpointError(f"{where} is {size} bytes, shorter than a safetensors header", file=where)
    (first,) = store.read(file, 0, [8]).result()
    length = layout.header_length(first.tobytes(), size, where)
    (raw,) = store.read(file, 8, [length]).result()
    return layout.decode_header(raw.tobytes(), size, file, where)


def _check(triples: Sequence[tuple[str, Any, Any]], found: Sequence[Named | None], entries: dict[str, layout.Entry], url: str) -> None:
    problems = []
    for (key, _, leaf), named in zip(triples, found):
        if named is None:
            continue
        entry = entries.get(named.name)
        if entry is None:
            problems.append(f"{key!r}: no tensor {named.name!r} in {url}")
            continue
        shape = tuple(reversed(entry.tensor.shape)) if named.transpose else entry.tensor.shape
        want, saved = np.dtype(leaf.dtype), dtype_from_name(entry.tensor.dtype)
        if tuple(leaf.shape) != shape:
            problems.append(f"{key!r}: shape {tuple(leaf.shape)}, but tensor {named.name!r} gives {shape}")
        elif want != saved and not (jnp.issubdtype(want, jnp.floating) and jnp.issubdtype(saved, jnp.floating)):
            problems.append(f"{key!r}: dtype {want}, but tensor {named.name!r} is {saved} (only float->float casts)")
    if problems:
        raise TargetMismatchError(
            f"{len(problems)} target leaves do not fit {url}:\n  " + "\n  ".join(problems),
            key=problems[0].split("'")[1], file=url,
        )


def _load_leaf(store: storage.Backend, entry: layout.Entry, named: Named, leaf: Any, batch: int) -> Any:
    dtype = np.dtype(leaf.dtype)
    if isinstance(leaf, np.ndarray):
        return _region(store, entry, named.transpose, full_slice(leaf.shape), dtype, batch)
    sharding = leaf.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    by_slice: dict[SliceSpec, list[jax.Device]] = {}
    shape = tuple(leaf.shape)
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_slice.setdefault(full_slice(shape) if index is None else index_to_slice(index, shape), []).append(device)
    arrays = []
    for spec, devices in by_slice.items():
        host = _region(store, entry, named.transpose, spec, dtype, batch)
        arrays.extend(jax.device_put([host] * len(devices), devices))
        jax.block_until_ready(arrays[-1])
    return jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, arrays)


def _region(store: storage.Backend, entry: layout.Entry, transpose: bool, spec: SliceSpec, dtype: np.dtype, batch: int) -> np.ndarray:
    """The slice ``spec`` of the target leaf, read from its tensor's runs of bytes."""
    stored = tuple(reversed(spec)) if transpose else spec
    saved = dtype_from_name(entry.tensor.dtype)
    out = storage.aligned_empty(math.prod(extent(stored)) * saved.itemsize)
    at = 0
    for runs in _batches(layout.runs_of(entry.tensor.shape, saved.itemsize, stored), batch):
        futures = [store.read(entry.file, entry.start + start, [length]) for start, length in runs]
        for future, (_, length) in zip(futures, runs):
            (chunk,) = future.result()
            out[at : at + length] = chunk
            at += length
    host = out.view(saved).reshape(extent(stored))
    if transpose:
        host = host.transpose()
    return host.astype(dtype, order="C", copy=False)


def _batches(runs: Iterator[tuple[int, int]], batch: int) -> Iterator[list[tuple[int, int]]]:
    """The runs in groups of about ``batch`` bytes, each read at once."""
    current: list[tuple[int, int]] = []
    size = 0
    for start, length in runs:
        for at in range(start, start + length, batch):  # a run longer than a batch, in parts
            part = (at, min(batch, start + length - at))
            if current and size + part[1] > batch:
                yield current
                current, size = [], 0
            current.append(part)
            size += part[1]
    if current:
        yield current
