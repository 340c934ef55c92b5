"""load_safetensors(): Hugging Face safetensors files straight onto a target's shardings.

The headers are read and checked first (``_hf_layout``), and the whole target with them:
every name, shape and dtype that does not fit is reported at once. Then, per leaf, the
distinct slices this process's devices hold (or the whole tensor, for a numpy target): their
bounding box, read once when they tile it, else each by itself, a batch of rows at a time,
each block read as the row-major runs of bytes it is made of (one run when its trailing
dimensions are whole), and copied into the slices it overlaps, which are then placed. The
reads run ahead across leaves, and a leaf's transfers to its devices overlap the next
leaves' reads: a model of many tensors waits on neither a leaf boundary nor a copy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.errors import CorruptCheckpointError, TargetMismatchError
from tpu_ckpt.format import SliceSpec, dtype_from_name, extent, flatten, full_slice, intersect, relative, volume
from tpu_ckpt.interop import _hf_layout as layout
from tpu_ckpt.interop._hf_names import Named, Names, resolve
from tpu_ckpt.options import CheckpointOptions, checked_options
from tpu_ckpt.settings import settings
from tpu_ckpt.sharding import index_to_slice

IN_FLIGHT = 4  # blocks whose reads are in flight at once, across leaves: a batch's bytes in all
PART_BYTES = 16 << 20  # at most, a block: several reads in flight keep a disk busy where one would not


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
        paths (``None``: the key path joined by ``.``, or the path below its first level
        where the files hold no such tensor, so that ``{"params": ...}`` loads what an export
        of the ``params`` subtree wrote); a ``transpose`` spec reverses the stored tensor's
        axes back. Several leaves may name one tensor (a tied embedding read as the
        embedding and as the output head).
      options: ``host_memory_limit`` bounds the bytes read at once (beyond the slices
        being assembled).

    Returns:
      ``target``'s tree with every array leaf read (a leaf whose spec is ``None`` comes back
      as given).

    Raises:
      TargetMismatchError: names missing from the files, shapes or dtypes that differ
        (only float->float casts are done), or target leaves that are not arrays, all
        listed at once.
      CorruptCheckpointError: a header or index that is malformed or hostile, a file that is
        missing, short or not a regular file.
    """
    folder, only = _source(storage.location(src))
    batch = _batch_bytes(checked_options(options, "load_safetensors"))
    triples, treedef = flatten(target)
    with storage.Store(folder) as store:
        entries = _catalog(store, folder, only)
        found = resolve(names, [(key, _default_name(key, entries)) for key, _, _ in triples], shared=True)
        _check(triples, found, entries, folder.url)
        plans = [_plan_leaf(entries[named.name], named, leaf, batch)
                 for (_, _, leaf), named in zip(triples, found) if named is not None]
        loaded = _load_leaves(store, plans, batch)
        results = [leaf if named is None else next(loaded) for (_, _, leaf), named in zip(triples, found)]
    return jax.tree_util.tree_unflatten(treedef, results)


def _default_name(key: str, entries: Mapping[str, Any]) -> str:
    """A target leaf's tensor name when ``names`` is None: its key path joined by ``.``, or,
    when the files have no such tensor, the path below its first level, as an export of the
    ``params`` subtree names it (``params/Dense_0/kernel`` -> ``Dense_0.kernel``)."""
    full = key.replace("/", ".")
    below = full.partition(".")[2]
    return below if full not in entries and below in entries else full


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
                raise CorruptCheckpointError(
                    f"{where} and {entries[entry.tensor.name].file} both hold tensor {entry.tensor.name!r}", file=where
                )
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


def _check(
    triples: Sequence[tuple[str, Any, Any]], found: Sequence[Named | None], entries: dict[str, layout.Entry], url: str
) -> None:
    problems = []
    for (key, _, leaf), named in zip(triples, found):
        if named is None:
            continue
        if not _array_like(leaf):
            problems.append(f"{key!r}: a {type(leaf).__name__} target; a safetensors tensor loads onto a jax.Array, "
                            "a jax.ShapeDtypeStruct or a numpy array (or map the leaf to None in names)")
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


def _array_like(leaf: Any) -> bool:
    """Whether ``leaf`` gives a shape and a plain dtype (not a typed PRNG key's) to load onto."""
    try:
        np.dtype(leaf.dtype), tuple(leaf.shape)  # a typed PRNG key's dtype is no numpy dtype
    except (AttributeError, TypeError):
        return False
    return True


@dataclasses.dataclass
class _LeafPlan:
    """One target leaf's reads: the distinct slices it needs as stored (``slices``, axes
    reversed when ``transpose``), the devices that hold each (``None``: a numpy target, the
    whole tensor), and the blocks of rows to read (``parts``), each a read in flight ahead."""

    entry: layout.Entry
    named: Named
    leaf: Any
    slices: list[SliceSpec]
    devices: list[list[jax.Device]] | None
    sharding: jax.sharding.Sharding | None
    parts: list[SliceSpec]


def _plan_leaf(entry: layout.Entry, named: Named, leaf: Any, batch: int) -> _LeafPlan:
    """The slices this process's devices hold (or the whole tensor, for a numpy target); their
    bounding box is read once when they tile it (a host's devices usually hold one block of the
    mesh), else each slice by itself, in blocks of rows of at most ``PART_BYTES``."""
    shape = tuple(leaf.shape)
    devices: list[list[jax.Device]] | None = None
    sharding = None
    if isinstance(leaf, np.ndarray):
        specs = [full_slice(shape)]
    else:
        sharding = leaf.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        by_slice: dict[SliceSpec, list[jax.Device]] = {}
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            by_slice.setdefault(full_slice(shape) if index is None else index_to_slice(index, shape), []).append(device)
        specs, devices = list(by_slice), list(by_slice.values())
    stored = [tuple(reversed(s)) if named.transpose else s for s in specs]
    box = tuple((min(s[d][0] for s in stored), max(s[d][1] for s in stored)) for d in range(len(stored[0])))
    itemsize, size = dtype_from_name(entry.tensor.dtype).itemsize, max(1, min(batch // IN_FLIGHT, PART_BYTES))
    tiled = sum(map(volume, stored)) == volume(box)
    parts = [part for each in ([box] if tiled else stored) for part in _row_blocks(each, itemsize, size)]
    return _LeafPlan(entry, named, leaf, stored, devices, sharding, parts)


def _load_leaves(store: storage.Backend, plans: Sequence[_LeafPlan], batch: int) -> Iterator[Any]:
    """Each planned leaf, read and placed in order. The next ``IN_FLIGHT`` blocks' reads, of
    the next leaves after a leaf's last, are in flight while a block is copied into its slices;
    a leaf's transfers to its devices run while the next leaves are read, until those not yet
    done hold more than ``batch`` bytes (then the oldest is waited for, its host copy let go)."""
    steps = [(plan, part) for plan in plans for part in plan.parts]
    reads = collections.deque(_start_box(store, *step) for step in steps[:IN_FLIGHT])
    started = len(reads)
    placing: collections.deque[tuple[list[jax.Array], int]] = collections.deque()
    for plan in plans:
        saved = dtype_from_name(plan.entry.tensor.dtype)
        hosts: list[np.ndarray | None] = [None] * len(plan.slices)
        for part in plan.parts:
            if started < len(steps):
                reads.append(_start_box(store, *steps[started]))
                started += 1
            _copy_into(hosts, plan.slices, part, _box(reads.popleft(), saved, part), saved)
        want = np.dtype(plan.leaf.dtype)
        slices = [_converted(np.empty(extent(s), saved) if h is None else h, plan.named.transpose, want)
                  for s, h in zip(plan.slices, hosts)]  # None: an empty slice
        if plan.devices is None or plan.sharding is None:
            yield slices[0]
            continue
        arrays = [a for host, on in zip(slices, plan.devices) for a in jax.device_put([host] * len(on), on)]
        placing.append((arrays, sum(host.nbytes for host in slices)))
        while sum(nbytes for _, nbytes in placing) > batch:
            jax.block_until_ready(placing.popleft()[0])
        yield jax.make_array_from_single_device_arrays(tuple(plan.leaf.shape), plan.sharding, arrays)


def _copy_into(
    hosts: list[np.ndarray | None], slices: Sequence[SliceSpec], part: SliceSpec, data: np.ndarray, saved: np.dtype
) -> None:
    """A block read into the slices it overlaps; a block that is exactly one slice is that
    slice, not copied."""
    for i, spec in enumerate(slices):
        overlap = intersect(spec, part)
        if spec == part:
            hosts[i] = data
        elif overlap is not None:
            host = hosts[i]
            if host is None:
                host = hosts[i] = storage.aligned_empty(volume(spec) * saved.itemsize).view(saved).reshape(extent(spec))
            host[relative(overlap, spec)] = data[relative(overlap, part)]


def _converted(host: np.ndarray, transpose: bool, dtype: np.dtype) -> np.ndarray:
    """A slice as stored, as the target wants it: axes reversed back, cast, row-major, and
    writable (an object store's bytes may be a read-only view)."""
    out = (host.transpose() if transpose else host).astype(dtype, order="C", copy=False)
    return out if out.flags.writeable else out.copy()


def _row_blocks(box: SliceSpec, itemsize: int, batch: int) -> Iterator[SliceSpec]:
    """``box`` cut along its first axis into blocks of about ``batch`` bytes (one row at least)."""
    if not box:
        yield box
        return
    (start, stop), rest = box[0], box[1:]
    rows = max(1, batch // max(1, volume(rest) * itemsize))
    for k in range(start, stop, rows):
        yield ((k, min(k + rows, stop)), *rest)


def _start_box(store: storage.Backend, plan: _LeafPlan, box: SliceSpec) -> list[tuple[concurrent.futures.Future, int]]:
    """Starts reading a block of the stored tensor: the row-major runs of bytes it is made of."""
    entry = plan.entry
    runs = layout.runs_of(entry.tensor.shape, dtype_from_name(entry.tensor.dtype).itemsize, box)
    return [(store.read(entry.file, entry.start + start, [length]), length) for start, length in runs]


def _box(reads: list[tuple[concurrent.futures.Future, int]], saved: np.dtype, box: SliceSpec) -> np.ndarray:
    """A block from its runs' reads (``_start_box``)."""
    if len(reads) == 1:  # one run (whole rows): the bytes read are the block
        return reads[0][0].result()[0].view(saved).reshape(extent(box))
    out = storage.aligned_empty(volume(box) * saved.itemsize)
    at = 0
    for future, length in reads:
        (chunk,) = future.result()
        out[at : at + length] = chunk
        at += length
    return out.view(saved).reshape(extent(box))
